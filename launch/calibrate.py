"""`make calibrate CLUSTER=<profile> [RUNS="dir ..."]`: fit the throughput model's constants on that cluster's own
finished runs and nights (overlapkit/regress/calibrate.py), print each run's residual and leave-one-out error, and
write the fit to runs/calibration/<cluster>.json, which plan, recipes and the nightly then predict with.

Exit status: 0 (fitted, or too few runs: the published constants kept, said which), 2 for bad input.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from launch.args import Parser
from overlapkit import stack
from overlapkit.errors import BadInput


def parse(argv):
    p = Parser(prog="make calibrate", description=__doc__)
    p.add_argument("--cluster", default="local", help="cluster profile whose runs are fitted (CLUSTER=)")
    p.add_argument("--runs", default="", help="directories to search for run directories (default: runs/)")
    return p.parse_args(argv)


def check(args) -> bool:
    """CLUSTER's profile and every RUNS directory before the Bridge import; each found run is re-planned (Bridge)."""
    from overlapkit.cluster.profiles import load_profile

    args.profile = load_profile(args.cluster)
    given = [Path(r) for r in args.runs.split()]
    if missing := [str(r) for r in given if not r.is_dir()]:
        raise BadInput(f"RUNS: no directory {', '.join(missing)}: give directories that hold run directories")
    args.roots = given or [r for r in (stack.runs_root(), args.profile.job_path) if r.is_dir()]
    return True


def run(args) -> int:
    from overlapkit.regress import calibrate
    from overlapkit.sizing import calibration

    stack.import_bridge()
    name = args.profile.name
    runs, skipped = calibrate.find_runs(args.roots, name)
    result = calibrate.calibrate(runs, name, dt.datetime.now(dt.UTC).date())
    written = calibration.save(name, result.calibration, result.runs) if result is not None else None
    print(calibrate.report(result, runs, skipped, name, written))
    return 0
