"""`make stack-diff STACK="megatron-bridge==0.6.0 megatron-core==0.19.0"`: what a candidate stack changes in every
recipe, planned under both stacks before any GPU-hour (docs/upgrading.md).

The candidate environment is built once by uv and reused (overlapkit/bridge/stackenv.py); each stack plans every
recipe (RECIPES=, and RECIPES_PATH's forks) in one process of its own (overlapkit/bridge/stackplan.py), the two at
once; the diff reads their records (overlapkit/nightly/stackdiff.py). This process never imports Bridge.
Exit status: 0 every recipe plans under both with a clean candidate audit, 1 some recipe fails to plan or its
candidate audit has errors, 2 bad input (a malformed STACK, an unknown package, a stack that does not install).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from launch.args import Parser
from overlapkit import jsonio, paths
from overlapkit.bridge import stackenv, stackplan
from overlapkit.errors import one_line
from overlapkit.nightly import stackdiff

OFFLINE_VAR = "OVERLAPKIT_STACK_OFFLINE"  # 1: uv resolves and installs from its cache only (tests)


def parse(argv):
    p = Parser(prog="make stack-diff", description=__doc__)
    p.add_argument("--stack", default="", help='candidate pins: "megatron-bridge==0.6.0 megatron-core==0.19.0"')
    p.add_argument("--recipes", default="", help="space/comma-separated recipe names (default: every recipe)")
    p.add_argument("--set", default="", help="SET= overrides applied to every recipe under both stacks")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--out", default="", help="a directory to write stackdiff.json and stackdiff.txt into")
    return p.parse_args(argv)


def check(args) -> bool:
    """STACK's pins, before anything is built: False, this process never needs Bridge (the planners import it)."""
    args.candidate = stackenv.parse(args.stack)
    return False


def _planned(proc, out: Path, names: list[str], side: str) -> dict:
    """A planner's output; a planner that died (Bridge does not import under that stack) fails every recipe with
    its last line."""
    _, err = proc.communicate()
    if proc.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    why = f"the {side} stack's planner exited {proc.returncode}: {one_line(last)}"
    return {"versions": {}, "load_errors": [why], "records": [{"recipe": n, "error": why} for n in names]}


def compare(candidate: stackenv.Stack, names=(), sets: str = "", keep=None) -> dict:
    """Build (or reuse) the candidate's environment, plan under both stacks at once, and diff the records (`keep`: a
    directory that gets both stacks' records too)."""
    env = stackenv.build(candidate, offline=os.environ.get(OFFLINE_VAR) == "1", say=lambda m: print(m, file=sys.stderr))
    run_env = stackenv.pythonpath()
    with tempfile.TemporaryDirectory(prefix="stackdiff-") as tmp:
        outs = {side: Path(tmp) / f"{side}.json" for side in ("pinned", "candidate")}
        pythons = {"pinned": sys.executable, "candidate": env.python}
        procs = {s: stackplan.start(pythons[s], outs[s], list(names), sets, run_env) for s in outs}
        pinned = _planned(procs["pinned"], outs["pinned"], list(names), "pinned")
        every = list(names) or [r["recipe"] for r in pinned["records"]]
        cand = _planned(procs["candidate"], outs["candidate"], every, "candidate")
    if keep:
        for side, records in (("pinned", pinned), ("candidate", cand)):
            jsonio.write_json(Path(keep) / f"{side}-records.json", records)
    d = stackdiff.diff(pinned, cand)
    d["stack"] = candidate.spec
    d["packages"] = stackenv.changed_packages(paths.REPO_ROOT / "uv.lock", env.lock)
    d["environment"] = {"path": str(env.root), "built": env.built}
    return d


def keep(d: dict, night_dir: Path | None) -> str:
    """`make nightly STACK=`: the diff into the night directory, where the night's report shows it beside the runs
    (nightly/stackdiff.night_section); a dry run has no night: the text itself."""
    if night_dir is None:
        return stackdiff.render(d)
    jsonio.write_json(night_dir / stackdiff.NIGHT_FILE, d)
    return f"candidate stack {d['stack']}: plan diff in {night_dir / stackdiff.NIGHT_FILE} (the report shows it)"


def run(args) -> int:
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    d = compare(args.candidate, args.recipes.replace(",", " ").split(), args.set, keep=out)
    text = stackdiff.render(d)
    if out:
        jsonio.write_json(out / "stackdiff.json", d)
        jsonio.write_text(out / "stackdiff.txt", text + "\n")
    print(json.dumps(d, indent=2) if args.format == "json" else text)
    return stackdiff.exit_status(d)
