"""`make nightly | nightly-report | bless | nightly-schedule | nightly-status | nightly-unschedule`: the nightly GPU
regression suite on a cluster profile, and the schedule that runs it every night.

Argument parsing and printing only; the work is overlapkit.regress.nightly and overlapkit.regress.schedule. submit:
every recipe (or RECIPES=) in its nightly shape (two steady steps profiled on rank 0 of each node), then a summary
job that runs `python -m launch nightly-report` after all of them. report: classify each run against its golden,
write report.md, junit.xml + plots, append the history; resubmit an infrastructure failure once. bless: a reviewed
run → nightly/goldens/<recipe>.json (with its exposed shares per overlap class). schedule: a scheduler job held
until AT that runs `submit` and queues itself for the next day (schedule-run is what it runs); schedule-status: that
chain and the last night; unschedule: cancel the chain.
Exit status: 0 ok, 1 failures (a regressed night, a broken chain), 2 bad input.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.args import Parser, add_gpu_option, switch
from overlapkit import stack
from overlapkit.cluster.submit import Interrupted
from overlapkit.errors import BadInput
from overlapkit.plan.inputs import positive_int
from overlapkit.regress import begin, chain_status, nightly, schedule
from overlapkit.regress import rules as regress


def parse(argv):
    ap = Parser(prog="launch.nightly", description=__doc__)
    ap.add_argument("action", choices=ACTIONS)
    ap.add_argument("--cluster", default="local", help="profile name in slurm/profiles/ or a path to a .toml")
    ap.add_argument("--job-dir", default="", help="override the profile's job_dir (tests)")
    ap.add_argument("--dryrun", type=switch, default="", help="1: say what would be submitted or queued; do neither")
    add_gpu_option(ap)
    ap.add_argument("--preflight", default="", help="1: preflight-only runs (CPU machines); env: skip the re-audit")
    ap.add_argument("--recipes", default="", help="space/comma-separated names (default: every recipe that fits)")
    ap.add_argument("--iters", type=positive_int, default=regress.NIGHTLY_ITERS)
    ap.add_argument("--min-dp", type=positive_int, default=nightly.MIN_DP)
    ap.add_argument("--max-nodes", type=positive_int, default=None, help="default: the partition's nodes (sinfo)")
    ap.add_argument("--night", default="", help="report: the night directory (default: the latest)")
    ap.add_argument("--run", default="", help="bless: the run directory")
    ap.add_argument("--goldens", default=str(regress.GOLDENS_DIR))
    ap.add_argument("--no-retry", action="store_true", help="report: do not resubmit infrastructure failures")
    ap.add_argument("--at", default="", help=f"schedule: when each night starts: {begin.FORMS}")
    return ap.parse_args(argv)


def profile_of(args):
    from overlapkit.cluster.profiles import load_profile, with_job_dir

    return with_job_dir(load_profile(args.cluster), args.job_dir)


def _say(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout)


def do_submit(args) -> int:
    from overlapkit.cluster.submit import preflight_mode

    preflight_only, checks = preflight_mode(args.preflight)
    nightly.check_gpu(args.gpu)
    stack.import_bridge()
    req = nightly.NightRequest(
        profile=profile_of(args),
        recipes=args.recipes.replace(",", " ").split(),
        iters=args.iters,
        min_dp=args.min_dp,
        preflight_only=preflight_only,
        checks=checks,
        max_nodes=args.max_nodes,
        goldens=args.goldens,
        dryrun=bool(args.dryrun),
    )
    nightly.submit_night(req, _say)
    return 0


def do_report(args) -> int:
    root = profile_of(args).job_path / "nightly"
    night_dir = Path(args.night) if args.night else nightly.latest_night(root)
    if night_dir is None:
        raise BadInput(f"no nights under {root}: run make nightly first, or give NIGHT=<dir>")
    ok = nightly.report_night(night_dir, goldens=Path(args.goldens), retry=not args.no_retry, say=print)
    return 0 if ok else 1


def do_bless(args) -> int:
    if not args.run:
        raise regress.BlessError("RUN='': give RUN=<run directory of a reviewed nightly run>")
    out = nightly.bless_run(Path(args.run), Path(args.goldens))
    print(f"blessed {args.run} -> {out}")
    return 0


def do_schedule(args) -> int:
    """Every check that needs no Bridge first (AT, PREFLIGHT, profile, partition): a typo answers at once and
    submits nothing. Recipe names need the registry (Bridge), so they are checked last, and only when given."""
    from overlapkit.cluster.submit import preflight_mode

    at = begin.check_at(args.at)
    preflight_mode(args.preflight)
    nightly.check_gpu(args.gpu)
    profile = profile_of(args)
    schedule.check_partition(profile)
    if names := args.recipes.replace(",", " ").split():
        schedule.check_recipes(names)
    req = schedule.ScheduleRequest(
        profile=profile,
        at=at,
        cluster=args.cluster,
        job_dir=args.job_dir,
        recipes=" ".join(names),
        preflight=args.preflight,
        iters=args.iters,
        min_dp=args.min_dp,
    )
    if args.dryrun:
        print("\n".join(schedule.dryrun_lines(req)))
        return 0
    sched, replaced = schedule.schedule(req)
    for line in schedule.scheduled_lines(sched, schedule.schedule_path(profile), replaced):
        print(line)
    return 0


def do_schedule_run(args) -> int:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise BadInput("schedule-run runs inside the scheduler job (no SLURM_JOB_ID here): use make nightly-schedule")
    return schedule.fire(profile_of(args), job_id, say=print)


def do_schedule_status(args) -> int:
    st = chain_status.status(profile_of(args), args.cluster)
    for line in st.lines:
        print(line)
    return 0 if st.ok else 1


def do_unschedule(args) -> int:
    sched, cancelled, running = schedule.unschedule(profile_of(args))
    for line in schedule.unscheduled_lines(args.cluster, sched, cancelled, running):
        print(line)
    return 0


ACTIONS = {
    "submit": do_submit,
    "report": do_report,
    "bless": do_bless,
    "schedule": do_schedule,
    "schedule-run": do_schedule_run,
    "schedule-status": do_schedule_status,
    "unschedule": do_unschedule,
}


def check(args) -> bool:
    """PREFLIGHT and the profile for every action; `submit` (the night plans and submits every recipe) and `schedule`
    with RECIPES= (the names need the registry) need Bridge, once AT and the partition pass; the others do not."""
    from overlapkit.cluster.submit import preflight_mode

    preflight_mode(args.preflight)
    nightly.check_gpu(args.gpu)
    if args.action == "schedule" and args.recipes.strip():
        begin.check_at(args.at)
        schedule.check_partition(profile_of(args))
        return True
    if args.action == "submit":
        profile_of(args)  # CLUSTER= and JOB_DIR= before the import
        return True
    return False


def handlers() -> None:
    from overlapkit.cluster.submit import install_signal_handlers

    install_signal_handlers()  # a night's submissions end marked (failed or submitted), even if make is killed


def run(args) -> int:
    try:
        return ACTIONS[args.action](args)
    except Interrupted as exc:
        print(f"error: {exc}; each run directory's submission.json says what became of it", file=sys.stderr)
        return 128 + exc.signum
