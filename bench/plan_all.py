"""`make plan` and `make recipes` against the bare Bridge import, measured side by side in one run.

Each repetition, in this order (so machine noise is shared): the bare `import megatron.bridge` in a fresh
interpreter (TE shim: what training and planning import); a first `make plan` in a fresh process with the plan
server off (OVERLAPKIT_PLAN_SERVER=0: the path every plan took before the server, and the one CI takes); a first
`make plan` with no server running (OVERLAPKIT_PLAN_SERVER=1: it starts the server and is its first command); at
once after it, with no wait, a second `make plan` (served: no second import, goal <= 2 s) and `make recipes`
(every recipe).
Prints each median (wall and CPU seconds: the CPUs may be shared) and the ratios; the cold-start row is the first
plan in a fresh process (server off) against the bare import, goal <= 0.7. `--cold` times only the first two. The
server lives in a private directory of this run (a server you are using is left alone) and is stopped at the end;
the run directories the plans wrote are removed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from overlapkit import paths
from overlapkit.cluster import plan_server

BARE = "from overlapkit.bridge import stack; stack.import_bridge()"
COLD_GOAL = 0.7
RECIPE = "llama3_70b_pretrain_64gpu_h100_bf16"
RUNS = paths.runs_root()


CPU: dict[str, list[float]] = {}  # user+sys seconds of each timed command (and its children), by row


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def timed(cmd: list[str], env: dict, row: str = "") -> float:
    t0, c0 = time.perf_counter(), _cpu()
    out = subprocess.run(cmd, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    CPU.setdefault(row, []).append(_cpu() - c0)
    return took


def cold_round(env: dict, times: dict) -> None:
    """The cold start: the bare import, and a first `make plan` in a fresh process (no server)."""
    times["bare"].append(timed([sys.executable, "-c", BARE], env, "bare"))
    times["plain"].append(timed(["make", "-s", "plan", f"RECIPE={RECIPE}"], {**env, plan_server.SWITCH: "0"}, "plain"))


def stop(env: dict) -> None:
    subprocess.run(["make", "-s", "plan-server-stop"], cwd=paths.REPO_ROOT, env=env, capture_output=True, check=True)


def one_round(env: dict, times: dict) -> None:
    make_plan = ["make", "-s", "plan", f"RECIPE={RECIPE}"]
    cold_round(env, times)
    stop(env)
    times["first"].append(timed(make_plan, env))
    times["second"].append(timed(make_plan, env))  # typed at once: served by the server the first one started
    times["recipes"].append(timed(["make", "-s", "recipes"], env))


LABELS = {
    "bare": "bare `import megatron.bridge` (TE shim only)",
    "plain": "first `make plan`, fresh process, server off",
    "first": "first `make plan` (no server: starts one)",
    "second": "second `make plan`, typed at once after it",
    "recipes": "`make recipes` (server warm, every recipe)",
}


def report(times: dict, reps: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items() if v}
    cpu = {k: statistics.median(v) for k, v in CPU.items() if k}
    print(f"{os.cpu_count()} CPUs, {reps} rounds, {RECIPE}")
    for key, label in LABELS.items():
        if key in med:
            spent = f"  CPU {cpu[key]:5.1f} s" if key in cpu else ""
            print(f"{label:<46} median {med[key]:5.1f} s{spent}  {[round(x, 1) for x in times[key]]}")
    print(
        f"cold start, first plan (fresh process, no server) / bare import: wall {med['plain'] / med['bare']:.2f}  "
        f"CPU {cpu['plain'] / cpu['bare']:.2f}  (goal <= {COLD_GOAL})"
    )
    if "second" in med:
        print(f"second plan at once after a cold first: {med['second']:.2f} s (goal <= 2 s)")
        print(
            f"ratio second plan / bare import: {med['second'] / med['bare']:.3f}   "
            f"recipes / bare import: {med['recipes'] / med['bare']:.3f}   "
            f"first plan / plain path: {med['first'] / med['plain']:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="only the cold start: bare import, first plan")
    opts = ap.parse_args()
    if opts.reps < 1:
        ap.error(f"--reps {opts.reps}: give at least 1")
    reps = opts.reps
    sockets = tempfile.mkdtemp(prefix="okps-bench-")
    env = {**os.environ, plan_server.DIR_VAR: sockets, plan_server.SWITCH: "1"}
    before = set(RUNS.glob(f"{RECIPE}-*")) if RUNS.is_dir() else set()
    times = {k: [] for k in LABELS}
    try:
        for _ in range(reps):
            cold_round(env, times) if opts.cold else one_round(env, times)
    finally:
        stop(env)
        shutil.rmtree(sockets, ignore_errors=True)
        for run_dir in set(RUNS.glob(f"{RECIPE}-*")) - before:
            shutil.rmtree(run_dir, ignore_errors=True)
    report(times, reps)


if __name__ == "__main__":
    main()
