"""`make nightly | nightly-report | bless`: the nightly GPU regression suite on a cluster profile.

Argument parsing and printing only; the work is overlapkit.regress.nightly. submit: every recipe (or RECIPES=) in its
nightly shape, then a summary job that runs `python -m launch.nightly report` after all of them. report: classify
each run against its golden, write report.md + plots, append the history; resubmit an infrastructure failure once.
bless: a reviewed run → nightly/goldens/<recipe>.json. Exit status: 0 ok, 1 failures, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from overlapkit import stack
from overlapkit.regress import nightly
from overlapkit.regress import rules as regress


def _args(argv):
    ap = argparse.ArgumentParser(prog="launch.nightly", description=__doc__)
    ap.add_argument("action", choices=("submit", "report", "bless"))
    ap.add_argument("--cluster", default="local", help="profile name in slurm/profiles/ or a path to a .toml")
    ap.add_argument("--job-dir", default="", help="override the profile's job_dir (tests)")
    ap.add_argument("--dryrun", default="")
    ap.add_argument("--preflight", default="", help="1: preflight-only runs (CPU machines); env: skip the re-audit")
    ap.add_argument("--recipes", default="", help="space/comma-separated names (default: every recipe that fits)")
    ap.add_argument("--iters", type=_positive, default=regress.NIGHTLY_ITERS)
    ap.add_argument("--min-dp", type=_positive, default=nightly.MIN_DP)
    ap.add_argument("--max-nodes", type=_positive, default=None, help="default: the partition's nodes (sinfo)")
    ap.add_argument("--night", default="", help="report: the night directory (default: the latest)")
    ap.add_argument("--run", default="", help="bless: the run directory")
    ap.add_argument("--goldens", default=str(regress.GOLDENS_DIR))
    ap.add_argument("--no-retry", action="store_true", help="report: do not resubmit infrastructure failures")
    return ap.parse_args(argv)


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def profile_of(args):
    from overlapkit.cluster.profiles import load_profile

    p = load_profile(args.cluster)
    return dataclasses.replace(p, job_dir=args.job_dir) if args.job_dir else p


def _say(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout)


def do_submit(args) -> int:
    from overlapkit.cluster.submit import preflight_mode

    preflight_only, checks = preflight_mode(args.preflight)
    stack.import_bridge()
    req = nightly.NightRequest(
        profile=profile_of(args), recipes=args.recipes.replace(",", " ").split(), iters=args.iters,
        min_dp=args.min_dp, preflight_only=preflight_only, checks=checks, max_nodes=args.max_nodes,
        goldens=args.goldens, dryrun=bool(args.dryrun),
    )  # fmt: skip
    nightly.submit_night(req, _say)
    return 0


def do_report(args) -> int:
    night_dir = Path(args.night) if args.night else nightly.latest_night(profile_of(args).job_path / "nightly")
    ok = nightly.report_night(night_dir, goldens=Path(args.goldens), retry=not args.no_retry, say=print)
    return 0 if ok else 1


def do_bless(args) -> int:
    if not args.run:
        raise regress.BlessError("RUN='': give RUN=<run directory of a reviewed nightly run>")
    out = nightly.bless_run(Path(args.run), Path(args.goldens))
    print(f"blessed {args.run} -> {out}")
    return 0


def main(argv=None) -> int:
    args = _args(argv)
    try:
        return {"submit": do_submit, "report": do_report, "bless": do_bless}[args.action](args)
    except (regress.BlessError, FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
