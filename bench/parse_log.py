"""`make parse-log` on a large log: the streaming parser next to a whole-file parse, measured side by side in one run.

    tools/uv.sh run --frozen --quiet python bench/parse_log.py               # a ~200 MB synthetic log
    tools/uv.sh run --frozen --quiet python bench/parse_log.py --mb 50       # smaller, quicker
    tools/uv.sh run --frozen --quiet python bench/parse_log.py --baseline-module old_logparse.py

The log is synthetic but every line is in Bridge 0.6.2's format, copied from what its own training_log() and
report_memory() print in tests/unit_tests/nightly/nightly_fixtures.py (iteration lines, the memory report, the
"Step Time" line), plus other ranks' NCCL chatter and our entry point's preflight line.
Each side runs in a fresh interpreter with its JSON written to a file: the streaming side is what `make parse-log`
runs (`python -m launch parse-log LOG`); the whole-file side reads the log into one string and builds the whole
dict before printing it (`to_json(parse_text(read_text()))`), which is what make parse-log did before, or runs an
older logparse module file as a script (--baseline-module). Wall time and peak RSS (ru_maxrss of the child, from
os.wait4) per side, their ratios, and whether the two JSON outputs are byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
ITER_LINE = (
    " [2026-12-01 17:15:54] iteration {i:8d}/{n:8d} | consumed samples: {s:12d} | elapsed time per iteration (ms):"
    " {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | learning rate: 1.000000E-04 | global batch size:"
    "   256 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 2.500 | number of skipped iterations:   0 |"
    " number of nan iterations:   0 |\n"
)
STEP_LINE = "Step Time : {sec:.2f}s GPU utilization: {tf:.1f}MODEL_TFLOP/s/GPU\n"
MEM_LINE = (
    "[Rank {r}] (after {i} iterations) memory (GB) | mem-allocated-gigabytes: 40.0 | mem-max-allocated-gigabytes:"
    " 61.5 | mem-max-reserved-gigabytes: 70.0 | mem-alloc-retires: 0\n"
)
NOISE = "[rank{r}]:node{node}:{pid}:{pid} [{r}] NCCL INFO Channel 07/0 : {r} -> {peer} via P2P/CUMEM/read\n"
WHOLE_FILE = (
    "import sys\nfrom pathlib import Path\nfrom overlapkit.nightly import logparse\n"
    "print(logparse.to_json(logparse.parse_text(Path(sys.argv[1]).read_text(errors='replace'))))\n"
)


def write_log(path: Path, mb: float) -> int:
    """A Bridge-format log of about `mb` MB; returns its iteration count."""
    per_iter = len(ITER_LINE.format(i=1, n=1, s=1, ms=1.0, tf=1.0, loss=1.0)) + len(STEP_LINE.format(sec=1, tf=1))
    per_iter += len(NOISE.format(r=1, node=1, pid=1, peer=1)) / 4
    n = max(1, int(mb * 1e6 / per_iter))
    with open(path, "w") as f:
        f.write("preflight: OK (64/64 ranks)\n")
        for i in range(1, n + 1):
            ms = 2000.0 + (i % 7) * 3.1
            f.write(STEP_LINE.format(sec=ms / 1000, tf=400.0 - (i % 5)))
            loss = 7.0 + 4.0 * 0.999**i
            f.write(ITER_LINE.format(i=i, n=n, s=i * 256, ms=ms, tf=400.0 - (i % 5), loss=loss))
            if i <= 2:
                f.writelines(MEM_LINE.format(r=r, i=i) for r in (0, 63))
            if i % 4 == 0:
                f.write(NOISE.format(r=i % 64, node=i % 8, pid=1000 + i % 64, peer=(i + 1) % 64))
    return n


def run(argv: list[str], out: Path) -> tuple[float, float]:
    """(wall s, peak RSS MB) of one child whose stdout goes to `out`."""
    t0 = time.perf_counter()
    with open(out, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, env=ENV, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(argv)} exited {proc.returncode}")
    return wall, usage.ru_maxrss / 1024  # Linux: kilobytes


def digest(path: Path, drop_launch: bool = False) -> str:
    """sha256 of a JSON output; drop_launch: without the `launch` key, which an older logparse did not write."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 16)))
        tail = f.read()
        cut = tail.rfind(b',\n  "launch": ') if drop_launch else -1
        end = size - len(tail) + cut if cut >= 0 else size
        h = hashlib.sha256()
        f.seek(0)
        while f.tell() < end:
            h.update(f.read(min(1 << 20, end - f.tell())))
        if cut >= 0:
            h.update(b"\n}\n")
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200.0, help="log size in MB (default 200)")
    ap.add_argument("--baseline-module", type=Path, help="an older logparse.py, run as a script, as the baseline")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-parse-log-") as tmp:
        log = Path(tmp) / "train.log"
        t0 = time.perf_counter()
        n = write_log(log, args.mb)
        size = log.stat().st_size / 1e6
        print(f"synthetic Bridge log: {size:.0f} MB, {n} iterations (written in {time.perf_counter() - t0:.1f} s)")
        if args.baseline_module:
            base = [sys.executable, str(args.baseline_module.resolve()), str(log)]
            label = f"{args.baseline_module.name} (whole file)"
        else:
            base, label = [sys.executable, "-c", WHOLE_FILE, str(log)], "whole-file parse_text + to_json"
        stream = [sys.executable, "-m", "launch", "parse-log", str(log)]
        wb, rb = run(base, Path(tmp) / "base.json")
        ws, rs = run(stream, Path(tmp) / "stream.json")
        drop = bool(args.baseline_module)
        same = digest(Path(tmp) / "base.json") == digest(Path(tmp) / "stream.json", drop_launch=drop)
        out_mb = (Path(tmp) / "stream.json").stat().st_size / 1e6
        print(f"{label:<40} wall {wb:6.1f} s   peak RSS {rb:7.0f} MB")
        print(f"{'streaming (make parse-log)':<40} wall {ws:6.1f} s   peak RSS {rs:7.0f} MB")
        print(f"ratio streaming / whole-file: wall {ws / wb:.2f}, peak RSS {rs / rb:.3f}")
        print(f"JSON output: {out_mb:.0f} MB, byte-identical: {same}" + (" (without `launch`)" if drop else ""))


if __name__ == "__main__":
    main()
