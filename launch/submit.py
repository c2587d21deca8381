"""`make submit|status|logs|cancel|sbatch|run-local`: launch an audited recipe on Slurm (nemo_run) or one node.

Argument parsing and printing only; the work is overlapkit.cluster (submit, sbatch, slurm). Nothing is submitted
when the audit has errors or the partition can never run the request. Exit status: 0 ok, 1 audit/job failure,
2 bad input, 128+N killed by signal N (the run directory is marked failed, or submitted with its job id).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from launch.args import Parser, add_run_options, request_of
from overlapkit import jsonio, makewatch, paths
from overlapkit.cluster import chain, runlock, sbatch, slurm, submit
from overlapkit.cluster.profiles import load_profile, placeholder_problem
from overlapkit.errors import BadInput, one_line
from overlapkit.spec.runopts import switch


def parse(argv):
    ap = Parser(prog="launch.submit", description=__doc__)
    ap.add_argument("action", choices=("submit", "status", "logs", "cancel", "sbatch", "run-local"))
    ap.add_argument("--recipe", default="")
    ap.add_argument("--cluster", default="local", help="profile name in slurm/profiles/ or a path to a .toml")
    ap.add_argument("--nodes", default="")
    ap.add_argument("--set", default="")
    ap.add_argument("--dryrun", type=switch, default="", help="1: print sbatch script, plan and ledger; submit nothing")
    ap.add_argument("--preflight", default="", help="1: stop after the in-job preflight; env: also skip the re-audit")
    ap.add_argument("--run", default="", help="run directory for status/logs/cancel (default: the latest)")
    ap.add_argument("--format", choices=("text", "json"), default="text", help="status: json prints the record")
    add_run_options(ap)
    ap.add_argument("--wait", action="store_true", help="submit: wait for the job to finish; exit 1 unless COMPLETED")
    return ap.parse_args(argv)


def do_submit(args, out, req, profile) -> int:
    from overlapkit.bridge import submission
    from overlapkit.bridge.report import render_plan

    preflight_only, checks = submit.preflight_mode(args.preflight)
    real, bound = args.action == "submit" and not args.dryrun, submission.bind(req, profile)
    dry = args.action == "submit" and not real
    sub = submission.submission(
        bound, profile, preflight_only=preflight_only, checks=checks, check_partition=real, dry=dry
    )
    with submit.transaction(sub):
        render_plan(sub.plan, out)
        if args.action == "sbatch":
            path = sbatch.write(sub)
            # what make submit records at once, a job of this script adds when it starts (submit.claim)
            ck = sub.plan.run.checkpoint_dir
            submit.mark(sub.run_dir, "sbatch-script", script=str(path), checkpoint_dir=ck, **sub.where())
            print(f"sbatch script: {path}")
            return 0
        if not real:
            text = submit.dryrun(sub)
            submit.mark(sub.run_dir, "dryrun")
            print(text)
            overrides = sub.run_dir / "overrides.json"
            print(f"# every rank runs launch/entry.py (the srun line above) with the overrides in {overrides}")
            print(f"dry run: nothing submitted; plan and ledger in {sub.run_dir}")
            if sub.profile.job_path != profile.job_path:  # submission() moved it: nothing on the cluster's filesystem
                print(f"(a dry run writes only under the checkout's runs/; a submit writes under {profile.job_path})")
            return 0
        sha, dirty = submit.shipped_commit()
        if dirty:  # the rank-0 re-audit also fails a job whose rebuilt recipe differs from this plan
            print(
                f"warning: uncommitted changes are not shipped (the job runs {sha[:12]}): {', '.join(dirty[:5])}",
                file=sys.stderr,
            )
        info = submit.submit(sub)
        jobs = info["job_ids"]
        chained = f"jobs {', '.join(jobs)} (each afterany the one before)" if len(jobs) > 1 else f"job {jobs[0]}"
        print(f"submitted {chained} to {sub.profile.name}; run directory: {sub.run_dir}")
        if not args.wait:
            return 0
        state = slurm.wait_for(info["job_id"])
        print(f"job {info['job_id']}: {state}")
        return 0 if state == "COMPLETED" else 1


def do_run_dir_action(args) -> int:
    run_dir, skipped = submit.run_dir_of(load_profile(args.cluster), args.run, submitted=args.action != "status")
    for line in skipped:  # another run's record that cannot be read: said, never in the way of this one
        print(f"note: {one_line(line)}", file=sys.stderr)
    if not run_dir.is_dir():
        raise BadInput(f"RUN={args.run!r} is not a directory: give RUN=<run directory> (make status: the latest)")
    info = submit.read_marker(run_dir, strict=True)
    if args.action == "status" and not info.get("job_id"):
        said = {"run": run_dir.name, "run_dir": str(run_dir), "state": info.get("state"), "said": submit.describe(info)}
        print(jsonio.dumps(said), end="") if args.format == "json" else print(f"{run_dir.name}: {said['said']}")
        return 1 if info.get("state") in ("failed", "submitting") else 0
    info = submit.load_submission(run_dir)  # logs and cancel need a job: one line saying why there is none
    if args.action == "status" and args.format == "json":
        print(jsonio.dumps({**chain.status(run_dir, info), "state": info.get("state")}), end="")
    elif args.action == "status":  # one line per job (segment), then the checkpoints
        print(f"{run_dir.name}:")
        print("\n".join(f"  {line}" for line in chain.status_lines(run_dir, info)))
    elif args.action == "logs":
        show_logs(info)
    elif len(chain.job_ids(info)) > 1:
        print("\n".join(f"{line} ({run_dir.name})" for line in chain.cancel(info)))
    elif ended := slurm.cancel(info["job_id"]):
        print(f"job {info['job_id']} ({run_dir.name}) already {ended}: nothing to cancel")
    else:
        print(f"cancelled job {info['job_id']} ({run_dir.name})")
    return 0


def show_logs(info: dict) -> None:
    """Every log of the job, as written, through the guarded reader; one that cannot be read is said in its place,
    the others still shown, then one error line."""
    logs, problems = chain.log_files(info), []
    for f in logs:
        print(f"==> {f} <==", flush=True)
        try:
            with jsonio.open_text(f) as text:
                shutil.copyfileobj(text, sys.stdout, 1 << 20)
        except (jsonio.Unreadable, FileNotFoundError) as exc:
            problems.append(str(exc) if isinstance(exc, jsonio.Unreadable) else f"{f}: no longer there")
            print(f"(not shown: {one_line(problems[-1])})")
        print()
    if not logs:
        where = info.get("experiment_dir") or info.get("log")
        print(f"no logs yet in {where} (job {info['job_id']}: make status says its state)")
    if problems:
        raise BadInput(f"{len(problems)} of the job's {len(logs)} log file(s) not shown: " + "; ".join(problems))


def checked(args):
    """Everything about a submit/sbatch/run-local request that needs no Bridge (a second, not a minute); returns (the
    request, not yet bound; the profile, None for run-local)."""
    req = request_of(args, action=args.action)
    if args.action != "submit" and req.run.segments > 1:
        raise BadInput(f"SEGMENTS={req.run.segments} is for make submit (a chain of Slurm jobs)")
    submit.preflight_mode(args.preflight)
    profile = None if args.action == "run-local" else load_profile(args.cluster)
    if profile and (placeholder := placeholder_problem(profile)):  # a dry run and a script for sbatch too
        raise BadInput(f"{placeholder}; nothing {'submitted' if args.action == 'submit' else 'written'}")
    if args.action == "submit" and not args.dryrun:  # what the partition can never run, before the import too
        from overlapkit.bridge import registry

        nodes = req.nodes or (registry.declared_nodes() or {}).get(req.recipe) or 1  # the recipe's, from its file
        if why := submit.unready(profile, nodes, profile.time_limit):
            raise BadInput(f"{why}; nothing submitted")
    if args.action == "sbatch" or (args.action == "submit" and not args.dryrun):
        # a live run on the checkpoint directory, before the import too (submit asks again under the lock); a
        # script for sbatch would start a second training on it just the same
        where = dataclasses.replace(req.run, job_dir=str(profile.job_path)).checkpoint_dir
        if where and (live := runlock.live_problem(Path(where), req.run.run_name)):
            raise BadInput(f"{live}; nothing {'submitted' if args.action == 'submit' else 'written'}")
    return req, profile


def check(args) -> bool:
    """status/logs/cancel need no Bridge; submit, sbatch and run-local are checked here and need it. run-local is never
    served: a server's worker must not parent its torchrun."""
    if args.action in ("status", "logs", "cancel"):
        return False
    args.request, args.profile = checked(args)
    return args.action != "run-local"


handlers = submit.install_signal_handlers  # a submission ends marked (failed or submitted), even if make is killed


def run(args) -> int:
    os.environ.setdefault("NEMORUN_HOME", str(paths.runs_root() / "nemo_run"))
    if args.action in ("status", "logs", "cancel"):
        return do_run_dir_action(args)
    from overlapkit.bridge import stack, submission
    from overlapkit.bridge.report import render_plan
    from overlapkit.profile.overlap_render import console

    stack.import_bridge()
    try:
        if args.action != "run-local":
            return do_submit(args, console(), args.request, args.profile)
        from overlapkit.bridge.build import plan_for

        preflight_only, checks = submit.preflight_mode(args.preflight)  # run-local: on this node, no Slurm
        plan = plan_for(submit.bind_local(args.request))
        render_plan(plan, console())
        if not plan.report.ok:
            return 1
        submission.run_local(plan, preflight_only=preflight_only, checks=checks, dryrun=bool(args.dryrun))
        return 0
    except makewatch.Interrupted as exc:
        print(f"error: {exc}; the run directory (if any) says what became of the submission", file=sys.stderr)
        return 128 + exc.signum
