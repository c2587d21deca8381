"""The real PyTorch-profiler traces in tests/data/reference_traces (Holistic Trace Analysis' test data, copied
unmodified with its MIT licence and a README of their provenance: real multi-GPU runs written by others) and the
independent computation the overlap report's figures are checked against: its own JSON parsing, its own step
projection, its own coverage sweep, nothing shared with the report. Used by the unit tests on the traces
(tests/unit_tests/profile/test_overlap_real_traces.py) and the end-to-end run on the local Slurm
(tests/e2e/test_torch_profile_e2e.py)."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

TRACE_DIR = Path(__file__).resolve().parent / "data" / "reference_traces"


def traces_dir() -> Path:
    """tests/data/reference_traces: the traces, their licence and their provenance (README.md there), in the repo."""
    return TRACE_DIR


TRACES = ("nccl_data", "trace_diff_control", "df_index_resolver", "trace_diff_test")


def ns(v) -> int:
    return int(Decimal(str(v)) * 1000)


def brute(path: Path) -> dict:
    """{"rank", "steps": [{class: (comm ns, exposed ns)}]} computed the long way: kernels by cat, NCCL by substring,
    each ProfilerStep's GPU span from the kernels and copies whose launch (by correlation) falls in it, coverage
    by sweeping every boundary."""
    data = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)
    ev = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: (ns(e["ts"]), e["tid"]) for e in ev if e.get("cat") == "cuda_runtime"}
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy")]
    steps = sorted(
        (ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["tid"])
        for e in ev
        if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
    )
    spans = []
    for lo, hi, tid in steps:
        inside = []
        for e in gpu:
            t = launch.get(e["args"]["correlation"])
            if t and t[1] == tid and lo <= t[0] <= hi:
                inside.append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])))
        if inside:
            spans.append([min(s for s, _ in inside), max(e for _, e in inside)])
    for a, b in zip(spans, spans[1:], strict=False):
        a[1] = max(a[0], min(a[1], b[0]))
    kinds = defaultdict(list)
    for e in gpu:
        iv = (ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]))
        if e["cat"] == "gpu_memcpy":
            if "PtoP" in e["name"]:
                kinds["tp"].append(iv)
        elif "nccl" not in e["name"]:
            kinds["compute"].append(iv)
        else:
            kinds["cp" if "SendRecv" in e["name"] else "dp"].append(iv)
    out = []
    for lo, hi in spans:
        row = {}
        for cls in ("dp", "cp", "tp"):
            if kinds[cls]:
                row[cls] = _covered(kinds[cls], kinds["compute"], lo, hi)
        out.append(row)
    return {"rank": data["distributedInfo"]["rank"], "steps": out}


def _covered(comm, compute, lo, hi) -> tuple[int, int]:
    """(ns in [lo, hi) covered by `comm`, ns of those not covered by `compute`): a sweep over every boundary."""
    points = sorted({lo, hi, *(x for iv in comm + compute for x in iv if lo < x < hi)})
    events = defaultdict(lambda: [0, 0])
    for s, e in comm:
        events[s][0] += 1
        events[e][0] -= 1
    for s, e in compute:
        events[s][1] += 1
        events[e][1] -= 1
    n_comm = sum(v[0] for t, v in events.items() if t <= lo)
    n_comp = sum(v[1] for t, v in events.items() if t <= lo)
    total = exposed = 0
    for a, b in zip(points, points[1:], strict=False):
        if a != lo:
            n_comm += events[a][0] if a in events else 0
            n_comp += events[a][1] if a in events else 0
        if n_comm > 0:
            total += b - a
            if n_comp == 0:
                exposed += b - a
    return total, exposed


def ms(n: int) -> float:
    """ns as the report gives them: milliseconds to the microsecond."""
    return round(n / 1e6, 3)
