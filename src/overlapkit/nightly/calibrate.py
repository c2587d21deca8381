"""`make calibrate`: the throughput model's constants fitted on a cluster's own finished runs and nights.

Each run directory under the given roots holds plan.json and the model inputs its plan predicted from (inputs.json,
sizing/throughput.py `read_inputs`): the fit re-predicts what ran, without Bridge. Its step time is the steady-state
mean of Bridge's `elapsed time per iteration (ms)` in the job's logs (nightly/logparse.py). A run counts only as the
plan it ran (the log's launch facts and the inputs' layout are plan.json's) with a step some physical constants can
give it; every problem of one run's files is that run's skip line, never the others' (read_run).

Which constants the runs can move is read off the model: the sensitivity of every run's step time to a 5% change of
each constant, in a pivoted QR; constants are taken in pivot order while their pivot is at least MOVE and fewer than
the runs (leave-one-out keeps one to predict), fitted by calibration.fit_free from the published values; the rest
keep the published values. Fewer than MIN_RUNS usable runs: nothing fitted; a fit that misses a run by more than
calibration.MAX_ERROR is refused (refusal) and not written.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import BadInput, one_line
from overlapkit.nightly import logparse, rules
from overlapkit.sizing import calibration, throughput
from overlapkit.spec import planfile

MIN_RUNS = 3  # fewer: nothing to fit with a run left over for leave-one-out
MIN_STEADY = 5  # steady-state iterations (after logparse's warm-up) a log needs to give a step time
MOVE = 0.05  # pivot of the runs' sensitivity matrix (d log step / d log constant) a constant needs to be fitted
STEP = 0.05  # the relative change of a constant the sensitivity is read at
# How far below a RUNS directory a run directory is looked for: the project writes them at runs/<run>,
# runs/local/<run>, <job_dir>/runs/<run> (and runs/slurm/runs/<run>, the local profile's job_dir inside runs/).
MAX_DEPTH = 3
EXPERIMENT = "_CONFIG"  # nemo_run marks its experiment directory with it (cluster/submit.py log_files)


@dataclass(frozen=True)
class Run:
    run_dir: Path
    recipe: str
    measured_s: float  # Bridge's steady-state mean step time
    steady: int  # iterations it is the mean of
    inputs: throughput.Inputs  # the plan's recorded model inputs (published constants)

    @property
    def kind(self) -> str:
        return calibration.kind(bool(self.inputs.moe.experts), self.inputs.w.dtype)


def read_run(run_dir: Path, cluster: str) -> Run | str:
    """The run, or why it does not count (one line)."""
    try:
        got = _read_run(Path(run_dir), cluster)
    except BadInput as exc:  # jsonio's FileProblem/Unreadable, a broken record, submit's log lookup
        got = str(exc)
    return got if isinstance(got, Run) else one_line(got)  # values from the files: shown escaped, one line


def _read_run(run_dir: Path, cluster: str) -> Run | str:
    plan = planfile.read_plan(run_dir)  # a broken plan.json: its own one line (file, field, fix)
    if plan.get("cluster") not in (None, cluster):
        return f"planned for cluster {plan.get('cluster')}"
    inputs = throughput.read_inputs(run_dir)
    was, w = plan["layout"], inputs.w
    shared = [k for k in planfile.SIZES + planfile.OPTIONAL_SIZES if k in was and hasattr(w, k)]
    if moved := [k for k in shared if was[k] != getattr(w, k)]:
        k = moved[0]
        return f"its {throughput.INPUTS} has {k}={getattr(w, k)}, its plan.json {k}={was[k]}: not this plan's inputs"
    if not (logs := job_logs(run_dir)):
        return "no log"
    parsed = logparse.parse_files(logs, exclude=logparse.profiled_iterations(plan))
    if why := step_problem(parsed):
        return why
    if wrong := rules.launch_disagreements(plan, parsed.get("launch") or {}, "fit"):
        return wrong[0]  # a log of another run: fitted against this plan it would move the constants anywhere
    summary = parsed["summary"]
    measured = summary["step_time_ms"] / 1e3
    if why := calibration.beyond_physics(lambda k: inputs.predict(k).step_s, measured):
        return why
    return Run(run_dir, plan["recipe"], measured, summary["steady_iterations"], inputs)


def job_logs(run_dir: Path) -> list[Path]:
    """The job's logs (submission.json names them: cluster/chain.py log_files) and any *.log beside plan.json; a
    submission record that is not the project's, or names a directory that is not nemo_run's: BadInput."""
    from overlapkit.cluster import chain

    info = jsonio.read_json(run_dir / chain.MARKER, role=chain.ROLE, fix=throughput.INPUTS_FIX, missing_ok=True)
    info = chain.checked_marker(run_dir, info) if info else {}  # each path field text, or its one line
    logs = chain.log_files(info) if info.get("experiment_dir") or info.get("log") else []
    return logs + sorted(run_dir.glob("*.log"))


def step_problem(parsed: dict) -> str | None:
    """Why the log gives no step time to fit on, naming the cause, or None."""
    summary = parsed["summary"]
    bad = [r for r in parsed["iterations"] if not r.get("step_time_ms", 1) > 0]  # ≤ 0 or NaN: no step takes that
    if bad:
        first = bad[0]
        return (
            f"its log's iteration {first['iteration']} took {first['step_time_ms']} ms ({len(bad)} iteration(s) "
            "with a step time ≤ 0 or not a number): not a log Bridge wrote of a training step"
        )
    steady = summary.get("steady_iterations") or 0
    if steady < MIN_STEADY:
        return f"{steady} steady-state iterations in its log (needs {MIN_STEADY}): let the run train longer"
    return None


def run_dirs(root: Path) -> tuple[list[Path], list[str]]:
    """(the run directories at most MAX_DEPTH below `root`, or `root` itself; the directories that could not be
    read, with why). A run directory holds plan.json and is not searched further; links, hidden directories and
    nemo_run's experiment directories (whose packaged code's test fixtures hold plan.json) are never entered."""
    found, unreadable, todo = [], [], [(Path(root), 0)]
    while todo:
        here, depth = todo.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
            below = [Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            unreadable.append(f"{here} ({exc.strerror or exc})")
            continue
        names = {e.name for e in entries}
        if planfile.PLAN in names:
            found.append(here)
        elif EXPERIMENT not in names and depth < MAX_DEPTH:
            todo += [(d, depth + 1) for d in below]
    return found, unreadable


def find_runs(roots: list[Path], cluster: str) -> tuple[list[Run], list[str]]:
    """(the usable runs under `roots`, 'run dir: why not' for the others and the directories not searched)."""
    runs, skipped, dirs, unreadable = [], [], set(), []
    for root in roots:
        got, bad = run_dirs(root)
        dirs |= set(got)
        unreadable += bad
    for run_dir in sorted(dirs):
        got = read_run(run_dir, cluster)
        if isinstance(got, Run):
            runs.append(got)
        else:
            skipped.append(f"{run_dir}: {got}")
    if unreadable:
        skipped.append(f"{len(unreadable)} directories could not be searched (first {unreadable[0]})")
    return runs, skipped


def _steps(runs: list[Run]):
    def predict(k: calibration.Constants) -> dict[str, float]:
        return {str(r.run_dir): r.inputs.predict(k).step_s for r in runs}

    return predict


def movable(runs: list[Run], base: calibration.Constants, most: int) -> list[str]:
    """The constants the runs can move and tell apart (pivoted QR of their sensitivities), at most `most`."""
    import numpy as np
    from scipy.linalg import qr

    predict = _steps(runs)
    at = predict(base)
    cols = []
    for n in calibration.NAMES:
        moved = predict(base.replace(**{n: getattr(base, n) * (1 + STEP)}))
        cols.append([math.log(moved[k] / at[k]) / math.log(1 + STEP) for k in at])
    _, r, order = qr(np.array(cols).T, pivoting=True, mode="economic")
    diag = np.abs(np.diag(r))
    return [calibration.NAMES[order[i]] for i in range(min(len(diag), most)) if diag[i] >= MOVE]


@dataclass(frozen=True)
class Result:
    calibration: calibration.Calibration
    runs: list[dict]  # per run: run_dir, recipe, measured, published and fitted predictions, residual, leave-one-out
    fitted: tuple[str, ...]
    refused: str | None = None  # why this fit must not be written (refusal), else None


def refusal(rows: list[dict], cal: calibration.Calibration) -> str | None:
    """Why the fit is not a calibration (one phrase), or None: a run it misses, in the fit or left out of it, by
    more than calibration.MAX_ERROR (or by NaN), or what make plan would refuse in the file (calibration.problem)."""
    for row in rows:
        for key, what in (("residual", "residual"), ("leave_one_out", "leave-one-out error")):
            if not (math.isfinite(row[key]) and abs(row[key]) <= calibration.MAX_ERROR):
                return (
                    f"run {Path(row['run_dir']).name}'s {what} is {row[key]:+.1%}, past ±{calibration.MAX_ERROR:.0%}: "
                    "the model cannot explain it at these constants; leave that run out of RUNS (or find what "
                    "slowed it) and run again"
                )
    return calibration.problem(cal)


def calibrate(runs: list[Run], cluster: str, today: dt.date) -> Result | None:
    """The cluster's calibration from `runs` (None: fewer than MIN_RUNS)."""
    if len(runs) < MIN_RUNS:
        return None
    base = calibration.FITTED
    free = movable(runs, base, len(runs) - 1)
    measured = {str(r.run_dir): r.measured_s for r in runs}
    k = calibration.fit_free(_steps(runs), measured, free, base)
    loo = {}
    for r in runs:
        others = [o for o in runs if o is not r]
        held = calibration.fit_free(_steps(others), {str(o.run_dir): o.measured_s for o in others}, free, base)
        loo[str(r.run_dir)] = r.measured_s / r.inputs.predict(held).step_s - 1
    bands = {}
    for kind in sorted({r.kind for r in runs}):
        errs = [loo[str(r.run_dir)] for r in runs if r.kind == kind]
        if len(errs) >= 2:  # one run is no spread: the published band of the kind stands
            bands[kind] = calibration.Band(min(errs), max(errs), len(errs), f"{len(errs)} {cluster} {kind} runs")
    kept = tuple(n for n in calibration.NAMES if n not in free)
    cal = calibration.Calibration(k, f"{cluster} fitted on {len(runs)} runs on {today.isoformat()}", bands, kept)
    rows = [
        {
            "run_dir": str(r.run_dir),
            "recipe": r.recipe,
            "steady_iterations": r.steady,
            "measured_step_s": round(r.measured_s, 4),
            "published_step_s": round(r.inputs.predict().step_s, 4),
            "fitted_step_s": round(r.inputs.predict(k).step_s, 4),
            "residual": round(r.measured_s / r.inputs.predict(k).step_s - 1, 4),
            "leave_one_out": round(loo[str(r.run_dir)], 4),
        }
        for r in runs
    ]
    return Result(cal, rows, tuple(free), refusal(rows, cal))


def report(result: Result | None, runs: list[Run], skipped: list[str], cluster: str, written: Path | None) -> str:
    """What make calibrate prints: every run's residual and leave-one-out error, each constant fitted or kept."""
    unrun = [s for s in skipped if s.endswith(": no log")]  # make plan's directories: plans that never ran
    lines = [f"skipped {s}" for s in skipped if s not in unrun]
    lines += [f"skipped {len(unrun)} run directories without a log (plans that never ran)"] if unrun else []
    if result is None:
        now = calibration.for_cluster(cluster).label
        lines += [
            f"{len(runs)} usable run(s) of cluster {cluster} (needs {MIN_RUNS}): nothing fitted; every constant keeps "
            f"its published value ({', '.join(calibration.NAMES)}); plan predicts with: {now}"
        ]
        return "\n".join(lines)
    lines.append(f"{'run':<60} {'measured s':>10} {'published':>10} {'fitted':>10} {'residual':>9} {'leave-1-out':>11}")
    for r in result.runs:
        lines.append(
            f"{Path(r['run_dir']).name[:60]:<60} {r['measured_step_s']:>10.3f} {r['published_step_s']:>10.3f} "
            f"{r['fitted_step_s']:>10.3f} {r['residual']:>+9.1%} {r['leave_one_out']:>+11.1%}"
        )
    cal = result.calibration
    for n in calibration.NAMES:
        was, now = getattr(calibration.FITTED, n), getattr(cal.constants, n)
        state = f"fitted: {now:.4g} (published {was:.4g})" if n in result.fitted else f"kept at published {was:.4g}"
        lines.append(f"  {n:<18} {state}" + ("" if n in result.fitted else ": these runs cannot move it"))
    for kind, b in cal.bands.items():
        lines.append(f"band {kind}: {b.low:+.1%}…{b.high:+.1%} (leave-one-out on {b.of})")
    if written is None:
        lines.append(
            f"fit not written; make plan CLUSTER={cluster} predicts with: {calibration.for_cluster(cluster).label}"
        )
    else:
        lines.append(f"{cal.label}: written to {written}; make plan CLUSTER={cluster} predicts with it")
    return "\n".join(lines)
