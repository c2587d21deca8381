"""`make plan` and `make recipes` against the bare Bridge import, measured side by side in one run.

Each repetition, in this order (so machine noise is shared): the bare `import megatron.bridge` in a fresh
interpreter; `make plan` with the plan server off (OVERLAPKIT_PLAN_SERVER=0: the path every plan took before the
server, and the one CI takes); a first `make plan` with no server running (it plans in its own process and starts
one alongside); once that server answers, a second `make plan` and `make recipes` (every recipe planned). Prints
each median and the ratios. The server lives in a private directory of this run (a server you are using is left
alone) and is stopped at the end; the run directories the plans wrote are removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from launch import plan_server
from overlapkit import stack

IMPORT = "from overlapkit import stack; stack.import_bridge()"
RECIPE = "llama3_70b_pretrain_64gpu_h100_bf16"
RUNS = stack.REPO_ROOT / "runs"


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=stack.REPO_ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    return took


def one_round(env: dict, paths: plan_server.Paths, times: dict) -> None:
    make_plan = ["make", "-s", "plan", f"RECIPE={RECIPE}"]
    times["import"].append(timed([sys.executable, "-c", IMPORT], env))
    times["plain"].append(timed(make_plan, {**env, plan_server.SWITCH: "0"}))
    plan_server.stop(paths)
    times["first"].append(timed(make_plan, env))
    if plan_server.wait_ready(paths, timeout=600) is None:
        sys.exit(f"error: the plan server did not answer within 600 s (log: {paths.log})")
    times["second"].append(timed(make_plan, env))
    times["recipes"].append(timed(["make", "-s", "recipes"], env))


LABELS = {
    "import": "bare `import megatron.bridge` (with TE shim)",
    "plain": "`make plan`, server off (the plain path)",
    "first": "first `make plan` (no server: starts one)",
    "second": "second `make plan` (server warm)",
    "recipes": "`make recipes` (server warm, 10 plans)",
}


def report(times: dict, reps: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{os.cpu_count()} CPUs, {reps} rounds, {RECIPE}")
    for key, label in LABELS.items():
        print(f"{label:<46} median {med[key]:5.1f} s  {[round(x, 1) for x in times[key]]}")
    print(
        f"ratio second plan / import: {med['second'] / med['import']:.3f}   "
        f"recipes / import: {med['recipes'] / med['import']:.3f}   "
        f"first plan / plain path: {med['first'] / med['plain']:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    reps = ap.parse_args().reps
    sockets = tempfile.mkdtemp(prefix="okps-bench-")
    env = {**os.environ, plan_server.DIR_VAR: sockets}
    env.pop(plan_server.SWITCH, None)
    paths = plan_server.Paths.of(environ=env)
    before = set(RUNS.glob(f"{RECIPE}-*")) if RUNS.is_dir() else set()
    times = {k: [] for k in LABELS}
    try:
        for _ in range(reps):
            one_round(env, paths, times)
    finally:
        plan_server.stop(paths)
        shutil.rmtree(sockets, ignore_errors=True)
        for run_dir in set(RUNS.glob(f"{RECIPE}-*")) - before:
            shutil.rmtree(run_dir, ignore_errors=True)
    report(times, reps)


if __name__ == "__main__":
    main()
