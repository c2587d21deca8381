"""The nightly's rule 6 (after rules.py's rule 5): each overlap class's exposed share of its communication, from the
run's overlap report (OVERLAP_JSON, written in the job or by `make overlap-report RUN=`), against the golden's, in
absolute percentage points. Rising beyond EXPOSED_MARGIN is a regression (an overlap stopped hiding that class),
falling beyond it an unexpected improvement; a golden with shares and a run without them is a regression that says
what is missing. The steps the nightly profiles for it (profile_window, profiled_ranks) are chosen here too.
"""

from __future__ import annotations

from pathlib import Path

from overlapkit import jsonio
from overlapkit.nightly import logparse
from overlapkit.profile.overlap_classes import CLASSES as EXPOSED_CLASSES  # the report's classes, in its order
from overlapkit.spec.runopts import OVERLAP_JSON, PROFILERS, planned_window
from overlapkit.spec.topology import GPUS_PER_NODE

# Two steady steps profiled on rank 0 of each node (its node's NVLink traffic and its share of every inter-node group,
# without a trace per GPU), in the middle of the steady iterations: the one-off costs of the first ones and the last
# one's exit work stay out, and steady iterations remain on both sides for the step-time mean, which leaves out the
# ones the capture slows (runopts.perturbed_iterations).
PROFILED_STEPS = 2


def profile_window(iters: int) -> tuple[int, int] | None:
    """NSYS=<start>:<end> for a night of `iters` iterations; None when too few are steady to profile two and still
    compare one (the report says so)."""
    skip = logparse.warmup_skip(iters)  # what logparse's summary leaves out
    steady = iters - skip
    if steady < PROFILED_STEPS + 2:  # the perturbed ones (the capture and the iteration after it) and one more
        return None
    start = skip + (steady - PROFILED_STEPS - 1) // 2
    return start, start + PROFILED_STEPS


def profiled_ranks(nodes: int) -> tuple[int, ...]:
    return tuple(range(0, nodes * GPUS_PER_NODE, GPUS_PER_NODE))


# In absolute points: a hidden class sits near 0 %, where a relative tolerance means nothing (2 % -> 3 % is +50 % and
# harmless), and a lost overlap moves it tens of points. Kernel-start jitter is a few points; 5 is above it. A
# starting value, as rules.LOSS_TIERS: recalibrate from >= 3 blessed runs.
EXPOSED_MARGIN = 0.05


def read(run_dir: Path) -> tuple[dict | None, str | None]:
    """(the run's overlap report, None) or (None, why there is none to read)."""
    path = Path(run_dir) / OVERLAP_JSON
    if not path.is_file():
        return None, f"no {OVERLAP_JSON} in the run directory"
    data = jsonio.read_json(path)
    if data is None or not isinstance(data.get("classes"), dict):
        return None, f"{OVERLAP_JSON} is not the overlap report's JSON (no classes object)"
    return data, None


def shares(report: dict | None) -> dict[str, float] | None:
    """{class: exposed share} for each class with communication in the report, in EXPOSED_CLASSES order."""
    if report is None:
        return None
    classes = report.get("classes") or {}
    out = {}
    for name in EXPOSED_CLASSES:
        c = classes.get(name) or {}
        if c.get("comm_ms") and isinstance(c.get("exposed_share"), int | float):
            out[name] = float(c["exposed_share"])
    return out


def compare(report: dict | None, missing: str | None, golden: dict) -> list[dict]:
    """One check per class the golden or the run has (a class the golden lacks had nothing exposed: 0), or one
    `missing` check when the run has no report (`missing`: read's reason); each says itself in `text`."""
    gold = golden.get("exposed_share")
    if not gold:  # a golden blessed before the nightly profiled, or from a run without communication
        return []
    if report is None:
        text = (
            f"exposed communication: {missing}, but the golden has exposed shares for {', '.join(gold)}: "
            "the night cannot show its overlaps hide them"
        )
        return [{"metric": "exposed_share", "value": None, "golden": gold, "verdict": "missing", "text": text}]
    run = shares(report)
    checks = []
    for name in [name for name in EXPOSED_CLASSES if name in gold or name in run]:
        value, base = run.get(name), gold.get(name, 0.0)
        d = None if value is None else value - base
        if d is None:
            verdict, text = "missing", f"{name} communication: none in the profile (golden exposed share {base:.1%})"
        else:
            verdict = "ok" if abs(d) <= EXPOSED_MARGIN else "worse" if d > 0 else "better"  # larger exposure is worse
            text = (
                f"{name} communication exposed {value:.1%} vs golden {base:.1%} "
                f"({d * 100:+.1f} points, margin ±{EXPOSED_MARGIN * 100:.0f})"
                + (": an overlap stopped hiding it" if verdict == "worse" else "")
            )
        check = {"metric": f"exposed_share.{name}", "value": value, "golden": base, "delta": d, "tol": EXPOSED_MARGIN}
        checks.append(check | {"verdict": verdict, "text": text})
    return checks


def bless_problem(run_dir: Path, plan: dict, report: dict | None, why: str | None, preflight_only: bool) -> str | None:
    """Why a profiled run may not become a golden: its exposed shares cannot be read (read's `why`), with the one
    command that writes them; None when they can, or the run was not profiled or did not train."""
    planned = planned_window(plan.get("run"))
    if not planned or report is not None or preflight_only:
        return None
    knob, (a, b) = PROFILERS[planned[0]][0], planned[1]["steps"]
    return (
        f"the run was profiled ({knob}={a}:{b}) but its exposed shares cannot be read ({why}): "
        f"write them (make overlap-report RUN={run_dir} writes {Path(run_dir) / OVERLAP_JSON}), then bless"
    )
