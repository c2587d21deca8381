"""`make calibrate CLUSTER=<profile> [RUNS="dir ..."]`: fit the throughput model's constants on that cluster's own
finished runs and nights (overlapkit/regress/calibrate.py), print each run's residual and leave-one-out error, and
write the fit to runs/calibration/<cluster>.json, which plan, recipes and the nightly then predict with.

Exit status: 0 (fitted, or too few runs: the published constants kept, said which), 2 for bad input.
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

from launch.args import Parser
from overlapkit import stack


def main(argv=None) -> int:
    p = Parser(prog="make calibrate", description=__doc__)
    p.add_argument("--cluster", default="local", help="cluster profile whose runs are fitted (CLUSTER=)")
    p.add_argument("--runs", default="", help="directories to search for run directories (default: runs/)")
    args = p.parse_args(argv)
    from overlapkit.cluster.profiles import load_profile
    from overlapkit.errors import BadInput
    from overlapkit.regress import calibrate
    from overlapkit.sizing import calibration

    try:
        profile = load_profile(args.cluster)
        roots = [Path(r) for r in args.runs.split()] or [stack.REPO_ROOT / "runs", profile.job_path]
        if missing := [str(r) for r in roots[: len(args.runs.split())] if not r.is_dir()]:
            raise BadInput(f"RUNS: no directory {', '.join(missing)}: give directories that hold run directories")
        stack.import_bridge()
        runs, skipped = calibrate.find_runs([r for r in roots if r.is_dir()], profile.name)
        result = calibrate.calibrate(runs, profile.name, dt.datetime.now(dt.UTC).date())
    except ValueError as exc:  # BadInput, ProfileError, FileProblem: one line naming the fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written = None
    if result is not None:
        written = calibration.save(profile.name, result.calibration, result.runs)
    print(calibrate.report(result, runs, skipped, profile.name, written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
