"""`make calibrate CLUSTER=<profile> [RUNS="dir ..."]`: fit the throughput model's constants on that cluster's own
finished runs and nights (overlapkit/nightly/calibrate.py), print each run's residual and leave-one-out error, and
write the fit to runs/calibration/<cluster>.json, which plan, recipes and the nightly then predict with.

Exit status: 0 (fitted, or too few runs: the published constants kept, said which; a run that cannot count is
skipped with its reason), 2 for bad input (a fit outside the physical bounds is refused: nothing written).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from launch.args import Parser
from overlapkit import paths
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput
from overlapkit.sizing import calibration


def parse(argv):
    p = Parser(prog="make calibrate", description=__doc__)
    p.add_argument("--cluster", default="local", help="cluster profile whose runs are fitted (CLUSTER=)")
    p.add_argument("--runs", default="", help="directories to search for run directories (default: runs/)")
    return p.parse_args(argv)


def check(args) -> bool:
    """CLUSTER's profile and every RUNS directory; the fit reads the runs' records alone, so no Bridge (False)."""
    args.profile = load_profile(args.cluster)
    calibration.path_of(args.profile.name)  # a name that would write outside runs/calibration: refused here
    whole = args.runs.strip()  # one directory whose path has spaces, else a space-separated list of them
    given = [Path(whole)] if whole and Path(whole).is_dir() else [Path(r) for r in whole.split()]
    if missing := [repr(str(r)) for r in given if not r.is_dir()]:
        split = " (RUNS is split at spaces)" if len(given) > 1 else ""
        raise BadInput(f"RUNS: no directory {', '.join(missing)}{split}: give directories that hold run directories")
    args.roots = given or [r for r in (paths.runs_root(), args.profile.job_path) if r.is_dir()]
    return False


def run(args) -> int:
    from overlapkit.nightly import calibrate

    name = args.profile.name
    runs, skipped = calibrate.find_runs(args.roots, name)
    result = calibrate.calibrate(runs, name, dt.datetime.now(dt.UTC).date())
    if result is not None and result.refused:  # the table says which run; nothing written, the old fit stands
        print(calibrate.report(result, runs, skipped, name, None))
        raise BadInput(f"fit refused, {calibration.path_of(name)} left as it was: {result.refused}")
    written = calibration.save(name, result.calibration, result.runs) if result is not None else None
    print(calibrate.report(result, runs, skipped, name, written))
    return 0
