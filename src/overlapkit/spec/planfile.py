"""The one reader of a run directory's plan.json (bridge/build.py writes it): every command that reads a plan back (make
status, make bless, the nightly's report, the overlap report, make calibrate, the in-job entry) gets it through
`read_plan`, checked field by field, or one line naming the file, the field and the fix. Standard library only:
launch/entry.py reads the plan before anything may import torch.

What is checked is what a reader relies on: the recipe's name (printed, so no control characters), the layout's
sizes (whole numbers ≥ 1: a plan with 0 GPUs or DP −4 is a broken file, not a profile to blame), the audit's shape,
and the run's checkpoint and profiler window (NSYS or TORCH_PROFILE). A plan.json that is a link is refused as one:
make plan writes a file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from overlapkit import jsonio

PLAN = "plan.json"
ROLE = "the run's plan that make plan/submit writes"
FIX = "plan it again (make plan), or give RUN= a run directory make plan/submit wrote"
RECIPE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # a module name under recipes/ (or a fork's)
# The layout's sizes: each a whole number ≥ 1 (vpp: none without interleaving; the MoE ones only on MoE plans).
SIZES = ("nodes", "gpus", "tp", "pp", "cp", "dp", "mbs", "gbs", "seq")
OPTIONAL_SIZES = ("vpp", "ep", "etp", "expert_dp", "experts", "topk")


def read_plan(run_dir: Path) -> dict:
    """`run_dir`/plan.json (or the file itself), checked; a FileProblem (one line) for anything a reader cannot use."""
    path = Path(run_dir)
    path = path if path.name == PLAN and not path.is_dir() else path / PLAN
    if path.is_symlink():
        raise jsonio.file_problem(path, f"is a symbolic link (to {os.readlink(path)!r})", ROLE, FIX)
    plan = jsonio.read_json(path, role=ROLE, fix=FIX, keys=("recipe", "layout", "audit"))
    if problem := plan_problem(plan):
        raise jsonio.file_problem(path, problem, ROLE, FIX)
    return plan


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def plan_problem(plan: dict) -> str | None:
    """What is wrong with a plan.json's content (field, value, what it should be), or None."""
    recipe = plan.get("recipe")
    if not isinstance(recipe, str) or not RECIPE_NAME.fullmatch(recipe):
        return f"recipe is {recipe!r}, not a recipe's name (letters, digits, _ . -)"
    lay = plan.get("layout")
    if not isinstance(lay, dict):
        return f"layout is {_kind(lay)}, not an object"
    for key in SIZES:
        if not _whole(lay.get(key)):
            return f"layout.{key} is {lay.get(key)!r}, not a whole number ≥ 1"
    for key in OPTIONAL_SIZES:
        if lay.get(key) is not None and not _whole(lay[key]):
            return f"layout.{key} is {lay[key]!r}, not a whole number ≥ 1 (or null)"
    if lay["gpus"] != lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]:
        return f"layout.gpus is {lay['gpus']}, not tp×pp×cp×dp = {lay['tp'] * lay['pp'] * lay['cp'] * lay['dp']}"
    audit = plan.get("audit")
    if not isinstance(audit, dict):
        return f"audit is {_kind(audit)}, not an object"
    rows = audit.get("rows")
    if not isinstance(rows, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("state"), str) for r in rows.values()
    ):
        return "audit.rows is not an object of {name: {state, detail}}"
    for key in ("errors", "warnings"):
        if not isinstance(audit.get(key, []), list) or not all(isinstance(f, dict) for f in audit.get(key, [])):
            return f"audit.{key} is not a list of findings"
    if (run := plan.get("run")) is None:
        return None
    if not isinstance(run, dict):
        return f"run is {_kind(run)}, not an object"
    if run.get("checkpoint_dir") is not None and not isinstance(run["checkpoint_dir"], str):
        return f"run.checkpoint_dir is {_kind(run['checkpoint_dir'])}, not a path"
    if run.get("train_iters") is not None and not _whole(run["train_iters"]):
        return f"run.train_iters is {run['train_iters']!r}, not a whole number ≥ 1"
    for key in ("nsys", "torch_profile"):  # the profiler's window, either: the overlap report and nightly read it
        if (window := run.get(key)) is None:
            continue
        steps, ranks = (window.get("steps"), window.get("ranks")) if isinstance(window, dict) else (None, None)
        ok_steps = isinstance(steps, list) and len(steps) == 2 and all(_whole(s) or s == 0 for s in steps)
        if not ok_steps or not isinstance(ranks, list) or not all(_whole(r) or r == 0 for r in ranks):
            return f"run.{key} is not {{steps: [start, end], ranks: [rank, ...]}} of whole numbers"
    return None


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:60]
