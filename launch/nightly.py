"""`make nightly | nightly-report | bless | nightly-schedule | nightly-status | nightly-unschedule`: the nightly GPU
regression suite on a cluster profile, and the schedule that runs it every night.

Argument parsing and printing only; the work is overlapkit.nightly.nightly and overlapkit.nightly.schedule. submit:
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

from launch import stack_diff
from launch.args import Parser, add_gpu_option, positive_int
from overlapkit.bridge import stackenv
from overlapkit.cluster import plan_server
from overlapkit.cluster.profiles import load_profile, with_job_dir
from overlapkit.cluster.submit import install_signal_handlers, preflight_mode
from overlapkit.errors import BadInput
from overlapkit.makewatch import Interrupted
from overlapkit.nightly import chain_status, nightly, schedule
from overlapkit.nightly import rules as regress
from overlapkit.spec.runopts import switch

# The commands Slurm jobs run (launch/commands.py's names; the library appends their options): the summary job under
# the profile's python (a site may name its container's), the scheduler job and its night under this one.
REPORT_COMMAND = ("-m", "launch", "nightly-report")
SCHEDULER_COMMANDS = schedule.Commands(
    night=(sys.executable, "-m", "launch", "nightly"),
    fire=(sys.executable, "-m", "launch", "nightly-schedule-run"),
)
SCHEDULE_OPTIONS = ("at", "cluster", "job_dir", "preflight", "iters", "min_dp")  # ScheduleRequest's, as given
ACTIONS = ("submit", "report", "bless", "schedule", "schedule-run", "schedule-status", "unschedule")


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
    ap.add_argument("--force", type=switch, default="", help="bless: 1 replaces the golden already there")
    ap.add_argument("--no-retry", action="store_true", help="report: do not resubmit infrastructure failures")
    ap.add_argument("--at", default="", help=f"schedule: when each night starts: {schedule.FORMS}")
    ap.add_argument("--stack", default="", help="submit: a candidate stack whose plan diff the report shows")
    return ap.parse_args(argv)


def profile_of(args):
    return with_job_dir(load_profile(args.cluster), args.job_dir)


def bridge():
    """The Bridge side of a night (laying out, planning and submitting its recipes), imported where it is needed."""
    from overlapkit.bridge import stack, submission

    stack.import_bridge()
    return submission


def _say(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout)


def check(args) -> bool:
    """PREFLIGHT, GPU and the profile for every action, and for `schedule` every check that needs no Bridge (AT, the
    partition): a typo answers at once and submits nothing. `submit` (the night plans and submits every recipe) and
    `schedule` with RECIPES= (the names need the registry) need Bridge; the others do not."""
    preflight_mode(args.preflight)
    nightly.check_gpu(args.gpu)
    if args.action == "schedule":
        schedule.check_partition(profile_of(args))
        schedule.first_begin(profile_of(args), args.at)
        return bool(args.recipes.strip())
    if args.action == "submit":
        profile_of(args)  # CLUSTER= and JOB_DIR= before the import
        args.candidate = stackenv.parse(args.stack) if args.stack.strip() else None
        return True
    return False


handlers = install_signal_handlers  # a night's submissions end marked (failed or submitted), even if make is killed


def run(args) -> int:
    """One action, after check(): its work, its lines printed, its exit status."""
    names, code = args.recipes.replace(",", " ").split(), 0
    try:
        match args.action:
            case "submit":
                preflight_only, checks = preflight_mode(args.preflight)
                side = bridge()
                req = nightly.NightRequest(
                    profile=profile_of(args),
                    recipes=names,
                    report_command=REPORT_COMMAND,
                    **{key: getattr(args, key) for key in ("iters", "min_dp", "max_nodes", "goldens")},
                    preflight_only=preflight_only,
                    checks=checks,
                    dryrun=bool(args.dryrun),
                    bridge=side,
                    versions=side.stack.versions(),
                )
                diff = stack_diff.compare(args.candidate, names) if args.candidate else None  # before submitting
                night_dir = nightly.submit_night(req, _say)
                lines = [stack_diff.keep(diff, night_dir)] if diff else []
            case "report":
                root = profile_of(args).job_path / "nightly"
                night_dir = Path(args.night) if args.night else nightly.latest_night(root)
                if night_dir is None:
                    raise BadInput(f"no nights under {root}: run make nightly first, or give NIGHT=<dir>")
                ok = nightly.report_night(
                    night_dir, REPORT_COMMAND, goldens=Path(args.goldens), retry=not args.no_retry, bridge=bridge
                )
                lines, code = [], 0 if ok else 1
            case "bless":
                if not args.run:
                    raise regress.BlessError("RUN='': give RUN=<run directory of a reviewed nightly run>")
                out = nightly.bless_run(Path(args.run), Path(args.goldens), force=bool(args.force))
                lines = [f"blessed {args.run} -> {out}"]
            case "schedule":
                if names:  # the names need the registry (Bridge), so they are checked after everything else
                    bridge().check_recipes(names)
                opts = {key: getattr(args, key) for key in SCHEDULE_OPTIONS} | {"dryrun": bool(args.dryrun)}
                req = schedule.ScheduleRequest(
                    profile_of(args), commands=SCHEDULER_COMMANDS, recipes=" ".join(names), **opts
                )
                lines = schedule.schedule(req)
            case "schedule-run":
                if not (job_id := os.environ.get("SLURM_JOB_ID")):
                    raise BadInput(
                        "schedule-run runs inside the scheduler job (no SLURM_JOB_ID here): use make nightly-schedule"
                    )
                # The night it fires plans in its own process, as every job does: a plan server started from this
                # job (which fire() strips of SLURM_*) would idle on the node for 15 minutes after the job ended.
                os.environ[plan_server.SWITCH] = "0"
                return schedule.fire(profile_of(args), job_id, SCHEDULER_COMMANDS)
            case "schedule-status":
                st = chain_status.status(profile_of(args), args.cluster)
                lines, code = st.lines, 0 if st.ok else 1
            case "unschedule":
                lines = schedule.unschedule(profile_of(args), args.cluster)
    except Interrupted as exc:
        print(f"error: {exc}; each run directory's submission.json says what became of it", file=sys.stderr)
        return 128 + exc.signum
    for line in lines:
        print(line)
    return code
