"""Reading one PyTorch-profiler trace (Kineto's Chrome-trace JSON, `.json` or gzipped `.json.gz`) into the same
Profile as an Nsight export (regress/nsys_sqlite.py), so the overlap report measures either the same way.

What Megatron Bridge 0.6.2 writes with `profiling.use_pytorch_profiler` (training/profiling.py
initialize_pytorch_profiler: `<tensorboard_dir>/../torch_profile/rank-<R>.json.gz`, one per profiled rank), and
what `torch.profiler.profile(...).export_chrome_trace` writes anywhere else. The fields used are Kineto's
(pytorch/kineto libkineto/src/output_json.cpp, as in the traces of Holistic Trace Analysis' test data):

- `traceEvents` with `ph: "X"` complete events: `cat` "kernel" (GPU kernels), "gpu_memcpy" (copies; "Memcpy PtoP"
  is a peer-to-peer copy, Nsight's copyKind 10), "cuda_runtime"/"cuda_driver" (the launches, tied to their kernel
  by `args.correlation`), "user_annotation" (record_function ranges on the CPU: `ProfilerStep#N` is one training
  step, torch/profiler/profiler.py `profile.step`). `ts` and `dur` are microseconds, whole or with three decimals
  (ns). GPU events carry `args.device`, `args.stream`, `args.correlation`.
- `distributedInfo.rank`: the global rank (torch/profiler/profiler.py `_get_distributed_info`).
- `deviceProperties[].name`: the GPUs.
- On an NCCL kernel, in recent PyTorch (2.2+: torch/csrc/profiler/util.cpp saveNcclMeta), `args["Process Group
  Description"]` (Megatron's group_desc, e.g. TENSOR_MODEL_PARALLEL_GROUP) and `args["Process Group Name"]`.

Why our own reader rather than Holistic Trace Analysis' (its TraceParser): HTA rounds every timestamp to whole
microseconds (and is a pandas stack this repository does not otherwise need); the report's figures are exact to the
nanosecond, so `ts` and `dur` are parsed from their decimal text (json's parse_float hook) into integer ns, never
through a float: 1.7e15 us times 1000 in float64 is off by up to 256 ns.
"""

from __future__ import annotations

import gzip
import json
import zlib
from decimal import Decimal, InvalidOperation
from pathlib import Path

from overlapkit.regress.nsys_sqlite import MEMCPY_PTOP, Profile, ProfileError, Range, activity, path_kind

GZIP_MAGIC = b"\x1f\x8b"
# Kineto's memcpy names ("Memcpy HtoD (Pageable -> Device)", ...) → CUPTI's copy kinds (cupti_activity.h
# CUpti_ActivityMemcpyKind), so a copy is treated as an Nsight export's would be.
COPY_KINDS = {"HtoD": 1, "DtoH": 2, "HtoA": 3, "AtoH": 4, "AtoA": 5, "AtoD": 6, "DtoA": 7, "DtoD": 8, "HtoH": 9}
COPY_KINDS["PtoP"] = MEMCPY_PTOP
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
STEP_PREFIX = "ProfilerStep#"
NOT_TRACE = "not a PyTorch-profiler trace (Kineto's JSON: torch.profiler's export_chrome_trace)"


def ns(v) -> int | None:
    """Microseconds (an int, or the decimal text json's parse_float hook kept) as exact integer nanoseconds; None for
    anything else."""
    if type(v) is int:
        return v * 1000
    if type(v) is str:
        whole, _, frac = v.partition(".")
        if whole.isdigit() and frac.isdigit() and len(frac) <= 3:  # Kineto's own form: exact and fast
            return int(whole) * 1000 + int(frac.ljust(3, "0"))
        try:
            return int((Decimal(v) * 1000).to_integral_value())
        except (InvalidOperation, ValueError):
            return None
    return None


def read(path: Path) -> Profile:
    """The trace in `path` as a Profile (kernels, memcpys, launches, ProfilerStep and other record_function ranges,
    GPUs, rank). Bad input: one ProfileError line."""
    path = Path(path)
    path_kind(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ProfileError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not raw.strip():
        raise ProfileError(f"{path} is empty: profile the run again")
    try:
        data = json.loads(raw, parse_float=str)  # decimals kept as text: ns() parses them exactly
    except (ValueError, RecursionError) as exc:
        raise ProfileError(f"{path} is not JSON ({getattr(exc, 'msg', exc)}): {NOT_TRACE}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ProfileError(f"{path} has no traceEvents list: {NOT_TRACE}")
    prof = Profile(path, [], [])
    info = data.get("distributedInfo")
    if isinstance(info, dict) and type(info.get("rank")) is int and info["rank"] >= 0:
        prof.rank = info["rank"]
    names: dict[str, str] = {}  # one string object per distinct name: a trace repeats each thousands of times
    for ev in data["traceEvents"]:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "user_annotation", *LAUNCH_CATS):
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        name = ev.get("name") if isinstance(ev.get("name"), str) else repr(ev.get("name"))
        name = names.setdefault(name, name)
        start, dur = ns(ev.get("ts")), ns(ev.get("dur"))
        end = start + dur if start is not None and dur is not None else None
        if cat in LAUNCH_CATS:
            if type(args.get("correlation")) is int and start is not None:
                prof.launches[args["correlation"]] = (start, ev.get("tid"))
        elif cat == "user_annotation":
            if start is not None and end is not None and end >= start:
                prof.ranges.append(Range(start, end, name, ev.get("tid")))
        else:
            a = (path, start, end, args.get("device"), args.get("stream"), name, args.get("correlation"))
            if cat == "kernel":
                group = args.get("Process Group Description") or args.get("Process Group Name") or ""
                prof.kernels.append(activity(*a, group=str(group)))
            else:
                kind = name.removeprefix("Memcpy ").split(" ")[0]
                prof.memcpys.append(activity(*a, copy_kind=COPY_KINDS.get(kind, 0), nbytes=args.get("bytes")))
    if not prof.kernels:
        raise ProfileError(f"{path} holds no GPU kernel: profile with CUDA activities on (ProfilerActivity.CUDA)")
    props = data.get("deviceProperties")
    if isinstance(props, list):
        by_id = {p.get("id"): p.get("name") for p in props if isinstance(p, dict)}
        prof.gpus = [str(by_id[d]) for d in prof.devices if by_id.get(d)]
    return prof
