"""`make bench` (second half): the overlap report at the size of a real run, side by side in one run.

A generated profile of RANKS ranks x KERNELS kernels per rank (Nsight SQLite exports: GEMMs and elementwise kernels
on the compute stream, DP's reduce-scatter / all-gather and PP's SendRecv on their own streams, every kernel
launched inside one of STEPS train_step NVTX ranges) is measured by the report (read, classify, sweep, per-step
figures, the timeline PNG) and by a plain single-pass sweep of the same rows (SQL, then one union and one subtraction
per class: the least any report must do). Then each report runs alone in a new process, on 1 rank and on all RANKS,
for its peak memory (ru_maxrss): ranks are streamed, so 8 should cost about what 1 does.

Both are timed in wall and in CPU seconds (this process's, time.process_time): on a shared machine the wall clock
counts other processes' turns, and the two sweeps run one after the other, under whatever load each meets; the CPU
time is the work each does. The report's modules and matplotlib are imported first and their time shown on a line of
its own: a one-off cost of the process, not of reading the rows.

Issue 45's bar: the report within 3x the plain sweep (issue 31's was 10x); 8 ranks within 400 MB of 1 rank.
"""

from __future__ import annotations

import random
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS, KERNELS, STEPS = 8, 200_000, 10
PLAN = {
    "recipe": "bench",
    "gpu": "h100",
    "layout": {"tp": 1, "pp": 2, "cp": 1, "dp": 4, "ep": 1, "gpus": 8, "nodes": 1, "gbs": 64, "mbs": 1, "vpp": 2},
    "audit": {"rows": {"overlap_grad_reduce": {"state": "on"}, "overlap_p2p_comm": {"state": "on"}}},
}
COMPUTE = [f"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize{n}x128x64_kernel" for n in (64, 128, 256)]
COMPUTE += [f"void at::native::vectorized_elementwise_kernel<4, Functor{i}>(int)" for i in range(40)]
COMM = [
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 30),
]


def generate(path: Path, rank: int) -> Path:
    """One rank's export: KERNELS kernels over STEPS steps, 1 in 8 communication."""
    rng = random.Random(rank)
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);"
        "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, streamId INT, "
        "correlationId INT, demangledName INT);"
        "CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, globalTid INT, correlationId INT, nameId INT);"
        "CREATE TABLE NVTX_EVENTS (start INT, end INT, eventType INT, text TEXT, textId INT, globalTid INT);"
    )
    names = COMPUTE + [n for n, _ in COMM]
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names)))
    kernels, launches, t, per_step = [], [], 1_000_000, KERNELS // STEPS
    steps = []
    for step in range(STEPS):
        begin = t
        for i in range(per_step):
            corr = step * per_step + i
            if i % 8 == 7:
                which = rng.randrange(len(COMM))
                name, stream = len(COMPUTE) + which, COMM[which][1]
                start, end = t - rng.randrange(0, 20_000), t + rng.randrange(5_000, 40_000)
            else:
                name, stream = rng.randrange(len(COMPUTE)), 7
                start, end = t, t + rng.randrange(2_000, 30_000)
                t = end + rng.randrange(0, 3_000)
            kernels.append((start, end, 0, stream, corr, name))
            launches.append((start - 5_000, start - 4_000, 42, corr, 0))
        steps.append((begin - 10_000, t, 59, "megatron.bridge.training.train.train_step", None, 42))
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?)", kernels)
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?)", launches)
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?)", steps)
    con.commit()
    con.close()
    return path


def plain_sweep(paths: list[Path]) -> dict[str, tuple[int, int]]:
    """Per class, communication and exposed ns over all ranks: SQL rows, one sort, one union and one subtraction."""
    out = {}
    for path in paths:
        con = sqlite3.connect(path)
        rows = con.execute(
            "SELECT k.start, k.end, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
            "JOIN StringIds s ON s.id = k.demangledName"
        ).fetchall()
        con.close()
        sets: dict[str, list] = {"compute": [], "dp": [], "pp": []}
        for s, e, name in rows:
            sets["pp" if "SendRecv" in name else "dp" if name.startswith("nccl") else "compute"].append((s, e))
        busy = merge(sets["compute"])
        for cls in ("dp", "pp"):
            comm = merge(sets[cls])
            total = sum(e - s for s, e in comm)
            covered, j = 0, 0
            for s, e in comm:
                while j < len(busy) and busy[j][1] <= s:
                    j += 1
                k = j
                while k < len(busy) and busy[k][0] < e:
                    covered += min(e, busy[k][1]) - max(s, busy[k][0])
                    k += 1
            a, b = out.get(cls, (0, 0))
            out[cls] = (a + total, b + total - covered)
    return out


def merge(ivs):
    out = []
    for s, e in sorted(ivs):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def report(paths: list[Path], png: Path) -> dict:
    from overlapkit.profile import overlap_report

    m = overlap_report.measure(paths, PLAN)
    rep = overlap_report.report_of(m)
    overlap_report.timeline_png(m, png)
    return rep


def peak_mb(paths: list[Path], png: Path) -> float:
    """The report's peak resident memory, alone in a new process."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import overlap_report as b; "
    code += f"from pathlib import Path; b.report([Path(p) for p in {[str(p) for p in paths]!r}], Path({str(png)!r}))"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(after, before) / 1024  # KiB on Linux


def timed(fn, *args):
    """(fn's result, wall seconds, CPU seconds of this process)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - w0, time.process_time() - c0


def _imports() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    from overlapkit.profile import overlap_render, overlap_report  # noqa: F401


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="overlapkit-bench-") as tmp:
        t0 = time.perf_counter()
        paths = [generate(Path(tmp) / f"rank{r}.sqlite", r) for r in range(RANKS)]
        print(f"generated {RANKS} ranks x {KERNELS:,} kernels in {time.perf_counter() - t0:.1f} s")
        _, w_imp, c_imp = timed(_imports)
        plain, w_plain, c_plain = timed(plain_sweep, paths)
        rep, w_rep, c_rep = timed(report, paths, Path(tmp) / "t.png")
        got = {c: (rep["classes"][c]["comm_ms"], rep["classes"][c]["exposed_ms"]) for c in plain}
        want = {c: (round(a / 1e6, 3), round(b / 1e6, 3)) for c, (a, b) in plain.items()}
        print(f"{'':34}{'wall s':>8}{'ratio':>7}{'CPU s':>8}{'ratio':>7}")
        print(f"{'plain sweep (SQL + merge)':34}{w_plain:8.2f}{1:7.1f}{c_plain:8.2f}{1:7.1f}")
        ratios = f"{w_rep / w_plain:7.1f}{c_rep:8.2f}{c_rep / c_plain:7.1f}"
        print(f"{'make overlap-report work (+ PNG)':34}{w_rep:8.2f}{ratios}   (bar: 3x)")
        print(f"{'  its imports, once (matplotlib)':34}{w_imp:8.2f}{'':7}{c_imp:8.2f}")
        print(f"same figures: {got == want} {got}")
        # a fresh process each (ru_maxrss of children is a running maximum: the small one first)
        one, all_ = peak_mb(paths[:1], Path(tmp) / "1.png"), peak_mb(paths, Path(tmp) / "8.png")
        print(f"peak memory: 1 rank {one:.0f} MB, {RANKS} ranks {all_:.0f} MB (+{all_ - one:.0f} MB; bar: 400)")


if __name__ == "__main__":
    main()
