"""`make calibrate`: the throughput model's constants fitted on a cluster's own finished runs and nights.

Each run directory under the given roots (runs/ and the cluster's nightly directories) holds plan.json, which names
the recipe, the cluster and the plan, and overrides.json, from which the plan is rebuilt exactly as the job built it
(plan/request.py `from_record`). Its step time is what Bridge's own log says: the steady-state mean of
`elapsed time per iteration (ms)` (regress/logparse.py, warm-up and profiled iterations left out) of the job's logs
(nemo_run's experiment directory from submission.json, and any *.log beside plan.json).

Which constants those runs can move is read off the model, not assumed: the sensitivity of every run's log step time
to a 5% change of each constant, in a pivoted QR (scipy.linalg.qr): constants are taken in pivot order while their
pivot is at least MOVE and fewer than the runs (one run is left over, so leave-one-out has something to predict).
They are fitted by calibration.fit_free (scipy's bounded least squares in log error, as the published fit), from
the published values; the rest keep the published values and are named. With fewer than MIN_RUNS usable runs
nothing is fitted.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.plan import planfile
from overlapkit.regress import logparse
from overlapkit.sizing import calibration, throughput

MIN_RUNS = 3  # fewer: nothing to fit with a run left over for leave-one-out
MIN_STEADY = 5  # steady-state iterations (after logparse's warm-up) a log needs to give a step time
MOVE = 0.05  # pivot of the runs' sensitivity matrix (d log step / d log constant) a constant needs to be fitted
STEP = 0.05  # the relative change of a constant the sensitivity is read at


@dataclass(frozen=True)
class Run:
    run_dir: Path
    recipe: str
    measured_s: float  # Bridge's steady-state mean step time
    steady: int  # iterations it is the mean of
    inputs: throughput.Inputs  # the rebuilt plan's model inputs (published constants)

    @property
    def kind(self) -> str:
        return calibration.kind(bool(self.inputs.moe.experts), self.inputs.w.dtype)


def read_run(run_dir: Path, cluster: str) -> Run | str:
    """The run, or why it does not count (one phrase)."""
    from overlapkit.cluster import submit
    from overlapkit.plan import request
    from overlapkit.plan.build import OVERRIDES, plan_for, prediction_inputs

    try:  # a broken plan.json: its own one line (file, field, fix), the other runs still count
        plan = planfile.read_plan(run_dir)
    except BadInput as exc:
        return str(exc)
    rec = jsonio.read_json(run_dir / OVERRIDES)
    if rec is None or "recipe" not in rec:
        return f"no readable {OVERRIDES}"
    if plan.get("cluster") not in (None, cluster):
        return f"planned for cluster {plan.get('cluster')}"
    # the job's logs: nemo_run's (submission.json names the experiment), a plain-sbatch job's (the log it recorded
    # when it started: cluster/submit.py claim), and any *.log beside plan.json
    info = jsonio.read_json(run_dir / "submission.json")
    logs = submit.log_files(info) if info and (info.get("experiment_dir") or info.get("log")) else []
    logs += sorted(run_dir.glob("*.log"))
    if not logs:
        return "no log"
    summary = logparse.parse_files(logs, exclude=logparse.profiled_iterations(plan))["summary"]
    steady, step_ms = summary.get("steady_iterations") or 0, summary.get("step_time_ms")
    if steady < MIN_STEADY or not step_ms or not math.isfinite(step_ms):
        return f"{steady} steady-state iterations in its log (needs {MIN_STEADY})"
    try:  # the recipe may have been renamed or edited since: that run cannot be rebuilt, the others still count
        plan_now = plan_for(request.from_record(rec, rec["recipe"], rec.get("nodes")))
    except BadInput as exc:  # UnknownRecipe, OverrideError, PlanError: the plan's own one line
        return f"its plan no longer builds: {exc}"
    return Run(run_dir, rec["recipe"], step_ms / 1e3, steady, prediction_inputs(plan_now))


def find_runs(roots: list[Path], cluster: str) -> tuple[list[Run], list[str]]:
    """(the usable runs under `roots`, 'run dir: why not' for the others)."""
    runs, skipped = [], []
    dirs = sorted({p.parent for root in roots for p in root.rglob("plan.json")})
    for run_dir in dirs:
        got = read_run(run_dir, cluster)
        if isinstance(got, Run):
            runs.append(got)
        else:
            skipped.append(f"{run_dir}: {got}")
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
    cal = calibration.Calibration(k, calibration.label(cluster, len(runs), today), bands, kept)
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
    return Result(cal, rows, tuple(free))


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
    lines.append(f"{cal.label}: written to {written}; make plan CLUSTER={cluster} predicts with it")
    return "\n".join(lines)
