"""Reading one PyTorch-profiler trace (Kineto's Chrome-trace JSON, `.json` or `.json.gz`) into the same Profile as
an Nsight export (profile/nsys_sqlite.py), so the overlap report measures either the same way.

What Bridge 0.6.2 writes with `profiling.use_pytorch_profiler` (training/profiling.py: `<tensorboard_dir>/../
torch_profile/rank-<R>.json.gz`) and `torch.profiler.profile(...).export_chrome_trace` anywhere else. Kineto's fields
(pytorch/kineto libkineto/src/output_json.cpp; Holistic Trace Analysis' test traces):

- `traceEvents`, `ph: "X"` complete events of `cat` "kernel", "gpu_memcpy" ("Memcpy PtoP": Nsight's copyKind 10),
  "cuda_runtime"/"cuda_driver" (launches, tied to their kernel by `args.correlation`) and "user_annotation"
  (record_function ranges; `ProfilerStep#N` is one step, torch/profiler/profiler.py `profile.step`). `ts` and `dur`
  are microseconds, whole or with three decimals; GPU events carry `args.device`, `args.stream`, `args.correlation`.
- `distributedInfo.rank` (the global rank), `deviceProperties[].name` (the GPUs), and on an NCCL kernel (PyTorch
  2.2+, torch/csrc/profiler/util.cpp saveNcclMeta) `args["Process Group Description"]` (Megatron's group_desc).

Our own reader rather than HTA's TraceParser: HTA rounds every timestamp to whole microseconds (and is a pandas
stack); the report is exact to the nanosecond, so `ts` and `dur` are parsed from their decimal text (json's
parse_float hook) into integer ns, never through a float (1.7e15 us x 1000 in float64 is off by up to 256 ns).
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

from overlapkit import jsonio
from overlapkit.profile.nsys_sqlite import (
    MAX_NS,
    MEMCPY_PTOP,
    NOT_WHOLE,
    Profile,
    ProfileError,
    Range,
    activity,
    path_kind,
)

# Kineto's memcpy names ("Memcpy HtoD (Pageable -> Device)", ...) → CUPTI's copy kinds (cupti_activity.h
# CUpti_ActivityMemcpyKind), so a copy is treated as an Nsight export's would be.
COPY_KINDS = dict(HtoD=1, DtoH=2, HtoA=3, AtoH=4, AtoA=5, AtoD=6, DtoA=7, DtoD=8, HtoH=9, PtoP=MEMCPY_PTOP)
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
STEP_PREFIX = "ProfilerStep#"
NOT_TRACE = "not a PyTorch-profiler trace (Kineto's JSON: torch.profiler's export_chrome_trace)"
# The longest number text read as a time: Kineto writes at most 20 characters (16 digits, a point, three decimals);
# a longer one is refused before any arithmetic, as is one whose exponent puts it past MAX_NS, so no number costs
# more than a few microseconds (9e999990 is a million-digit integer).
MAX_TEXT = 40
MAX_US_DIGITS = len(str(MAX_NS // 1000))


class Num(str):
    """A JSON number with a fraction or an exponent, kept as its text (json's parse_float hook) so that ns() parses
    it exactly; a JSON string is never one."""

    __slots__ = ()


def number(text: str) -> Num:
    """json's parse_float: a finite number (jsonio.strict_float's rule: 1e999 is not one), kept as its text."""
    jsonio.strict_float(text)
    return Num(text)


def ns(v) -> int | None:
    """Microseconds (a JSON integer, or a Num) as exact integer nanoseconds; None for anything that is not a number
    (a string, null, a list); ValueError for a number no time can be (too long a text, too large an exponent)."""
    if type(v) is int:
        return v * 1000
    if type(v) is not Num:
        return None
    if len(v) > MAX_TEXT:
        raise ValueError(f"the time {v[:24]}... has {len(v)} characters, not a time in microseconds")
    whole, _, frac = v.partition(".")
    if whole.isdigit() and frac.isdigit() and len(frac) <= 3:  # Kineto's own form: exact and fast
        return int(whole) * 1000 + int(frac.ljust(3, "0"))
    d = Decimal(v)  # the JSON number grammar: always a finite decimal
    if d.adjusted() >= MAX_US_DIGITS:
        raise ValueError(f"the time {v} us is past 2^62 ns")
    if d.adjusted() < -6:  # under a thousandth of a nanosecond: rounds to 0, whatever its exponent
        return 0
    return int((d * 1000).to_integral_value())


def _decode(path: Path):
    """The trace's JSON through the one guarded reader (a regular file, TRACE_LIMIT, bounded gunzip) with strict
    numbers (integers within int64, finite decimals), or one ProfileError line."""
    try:
        raw = jsonio.read_bytes(path, jsonio.TRACE_LIMIT)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except jsonio.Unreadable as exc:
        raise ProfileError(f"{exc}: {NOT_WHOLE}" if "gzip" in exc.what else str(exc)) from None
    if not raw or raw.isspace():
        raise ProfileError(f"{path} is empty: profile the run again")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path} is not text (byte {exc.start + 1} is not UTF-8): {NOT_TRACE}") from None
    del raw  # one copy of a large trace at a time
    try:
        return jsonio.loads(text, parse_float=number)  # decimals kept as text: ns() parses them exactly
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}): {NOT_TRACE}") from None
    except RecursionError:
        raise ProfileError(f"{path} is nested too deeply for a trace: {NOT_TRACE}") from None
    except ValueError as exc:  # jsonio's strict numbers
        raise ProfileError(f"{path}: {exc}: {NOT_WHOLE}") from None


def _odd(path: Path, what: str, value) -> ProfileError:
    text = repr(value)
    return ProfileError(f"{path}: {what} is {text[:60]}{'...' if len(text) > 60 else ''}: {NOT_WHOLE}")


def read(path: Path) -> Profile:
    """The trace in `path` as a Profile (kernels, memcpys, launches, ProfilerStep and other record_function ranges,
    GPUs, rank). Bad input: one ProfileError line."""
    path = Path(path)
    path_kind(path)
    data = _decode(path)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ProfileError(f"{path} has no traceEvents list: {NOT_TRACE}")
    prof = Profile(path, [], [])
    info = data.get("distributedInfo")
    if isinstance(info, dict) and type(info.get("rank")) is int and info["rank"] >= 0:
        prof.rank = info["rank"]
    names: dict[str, str] = {}  # one string object per distinct name: a trace repeats each thousands of times
    for ev in data["traceEvents"]:
        if isinstance(ev, dict) and ev.get("ph") == "X" and ev.get("cat") in CATS:
            _event(path, ev, prof, names)
    if not prof.kernels:
        raise ProfileError(f"{path} holds no GPU kernel: profile with CUDA activities on (ProfilerActivity.CUDA)")
    props = data.get("deviceProperties")
    if isinstance(props, list):
        by_id = {}
        for i, p in enumerate(x for x in props if isinstance(x, dict)):
            if type(p.get("id")) is not int:
                raise _odd(path, f"deviceProperties[{i}].id", p.get("id"))
            by_id[p["id"]] = p.get("name")
        prof.gpus = [str(by_id[d]) for d in prof.devices if by_id.get(d)]
    return prof


CATS = ("kernel", "gpu_memcpy", "user_annotation", *LAUNCH_CATS)


def _event(path: Path, ev: dict, prof: Profile, names: dict) -> None:
    """One complete event of a kind the report reads, added to `prof`; an odd field is one ProfileError line."""
    cat, name = ev["cat"], ev.get("name")
    if type(name) is not str:
        raise _odd(path, f"the name of a {cat} event", name)
    name = names.setdefault(name, name)
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    try:
        start, dur = ns(ev.get("ts")), ns(ev.get("dur"))
    except ValueError as exc:
        raise ProfileError(f"{path}: {cat} event {name[:120]!r}: {exc}: {NOT_WHOLE}") from None
    end = start + dur if start is not None and dur is not None else None
    if cat in LAUNCH_CATS or cat == "user_annotation":
        if (tid := ev.get("tid")) is not None and type(tid) not in (int, str):  # a thread: a key, so int or text
            raise _odd(path, f"the tid of {cat} event {name[:120]!r}", tid)
        if start is not None and not 0 <= start <= MAX_NS or end is not None and not 0 <= end <= MAX_NS:
            raise ProfileError(f"{path}: {cat} event {name[:120]!r} is outside 0..2^62 ns ({start} ns): {NOT_WHOLE}")
        if cat != "user_annotation":
            if type(args.get("correlation")) is int and start is not None:
                prof.launches[args["correlation"]] = (start, tid)
        elif start is not None and end is not None and end >= start:
            prof.ranges.append(Range(start, end, name, tid))
        return
    a = (path, start, end, args.get("device"), args.get("stream"), name, args.get("correlation"))
    if cat == "kernel":
        group = args.get("Process Group Description") or args.get("Process Group Name") or ""
        prof.kernels.append(activity(*a, group=group if type(group) is str else str(group)[:200]))
    else:
        kind = name.removeprefix("Memcpy ").split(" ")[0]
        prof.memcpys.append(activity(*a, copy_kind=COPY_KINDS.get(kind, 0), nbytes=args.get("bytes")))
