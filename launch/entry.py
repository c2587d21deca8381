"""The in-job entry point: what every rank runs.

1. Preflight, on every rank, with the standard library only (64 ranks × a 1.3 GB Bridge import cannot work on a
   small node, and the checks must run before anything initialises CUDA): the process environment holds exactly
   the ledger's values (CUDA_DEVICE_MAX_CONNECTIONS in particular must come from the launcher: read at CUDA init,
   setting it from Python later does nothing), Slurm's world size/ranks match the plan, Transformer Engine is
   importable where TP overlap is on (on GPU nodes), and userbuffers can bootstrap (PMIx from `srun --mpi=pmix`).
   Each rank writes `preflight/rank-NNNNN.json` into the run directory.
2. Rank 0 (with `--checks full`) also rebuilds the recipe by name with the same overrides, re-audits it, checks the
   audit still matches the submitted plan, and writes `preflight.json` with every rank's result.
3. First of all, every rank runs the resume guard (cluster/resume.py) on the run's checkpoints: a later segment
   without a tracker exits 1 (never a silent start from iteration 0: Bridge's `exit_on_missing_checkpoint` ends with
   status 0), an incomplete tracked iteration falls back to the last complete one (or exits 1), a changed layout
   exits 1, and a run already at train_iters exits 0, rank 0 cancelling the later segments.
4. Unless `--preflight-only`: rank 0 records the layout beside the checkpoints, then Bridge's
   `pretrain(cfg, forward_step)` with the GPT forward step; a run that reached train_iters cancels the later segments.

With NSYS=a:b, before any of this, a profiled rank starts itself again under `nsys profile` (the child goes through
the steps above) and exports the report when the child ends; the first profiled rank then writes the run's overlap
report, and every rank waits for it after training (overlapkit/profile/profiled.py). With TORCH_PROFILE=a:b, Bridge's
PyTorch profiler traces those steps in the training itself; after it, the profiled ranks copy their traces into the
run directory and the first one writes the report the same way.

It runs as a path-based script (`python launch/entry.py ...`), so Bridge's run plugins (PreemptionPlugin) work
unchanged: their `key=value` overrides arrive as extra arguments and are applied after the run directory's
overrides.json (the SET pairs exactly as typed, and the run options).

`--claim` is the plain-sbatch script's first step, one task before the ranks: the job records itself as the run's,
where make submit records its jobs, or stops where another run is live on its checkpoints (cluster/submit.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# A path-based script: its own checkout's src/ and root on the path, whatever the launcher's PYTHONPATH.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(_ROOT / "src"), str(_ROOT)) if p not in sys.path]

from overlapkit.cluster import chain, preflight, resume  # noqa: E402  (pydantic, no torch or Bridge)
from overlapkit.errors import BadInput, one_line  # noqa: E402  (standard library only)
from overlapkit.jsonio import write_json  # noqa: E402  (standard library only: safe before the environment check)
from overlapkit.profile import profiled  # noqa: E402  (standard library only at import)
from overlapkit.spec import planfile, runopts  # noqa: E402  (pydantic, no torch or Bridge)
from overlapkit.spec.topology import env_int  # noqa: E402  (standard library only at import)


def rebuild(args):
    """The recipe planned again in the job from overrides.json, then the plugins' overrides (imports Bridge: after
    the preflight)."""
    from overlapkit.bridge import stack

    stack.import_bridge()
    from overlapkit.bridge import request
    from overlapkit.bridge.build import plan_for

    rec = json.loads((args.run_dir / runopts.OVERRIDES).read_text())
    return plan_for(request.from_record(rec, args.recipe, args.nodes, args.plugin_sets))  # bound at submit


def resume_guard(args, plan: dict) -> int | None:
    """What this segment does with the run's checkpoints (cluster/resume.py): exit now with a status (no checkpoint
    for a later segment, an incomplete one with nothing before it, a changed layout, training over), or go on
    (args.ckpt_step: the iteration to load when the tracker's is incomplete). Rank 0 speaks for all, and cancels
    the later segments of a run that is over."""
    rank0 = not env_int("SLURM_PROCID", "RANK")
    where = f"segment {args.segment}/{args.segments}"
    verdict = resume.guard(plan.get("run") or {}, plan["layout"], where, later_segment=args.segment > 1)
    for line, error in verdict.lines if rank0 else ():
        print(line, file=sys.stderr if error else sys.stdout)
    for line in chain.cancel_after(args.run_dir, args.segment) if verdict.code == 0 and rank0 else ():
        print(line)
    args.ckpt_step, args.resume = verdict.ckpt_step, verdict.resume
    # A failure is rank 0's to exit with: another rank exiting non-zero first has srun (--kill-on-bad-exit) cancel
    # the step, rank 0 too, often before it has printed why; rank 0's status fails the step and the job all the same.
    return verdict.code if rank0 or not verdict.code else 0


def run_options(run_dir: Path) -> runopts.RunOptions:
    """This run's options as the job applies them (overrides.json, what rebuild applies): where this rank's config
    saves and loads checkpoints, under which RUN_NAME."""
    return runopts.RunOptions.from_dict(json.loads((run_dir / runopts.OVERRIDES).read_text()).get("run"))


def claim(args) -> int:
    """The plain-sbatch script's first step (slurm/templates/pretrain.sbatch), one task: this job recorded as the
    run's where make submit records its jobs, or stopped where another run is live on its checkpoints
    (cluster/submit.py claim)."""
    from overlapkit.cluster import submit

    info = submit.claim(args.run_dir, os.environ.get("SLURM_JOB_ID", ""), run_options(args.run_dir))
    where = args.run_dir / chain.MARKER
    print(f"job {info['job_id']}: recorded in {where} (make status|logs|cancel RUN={args.run_dir})")
    return 0


def _args(argv):
    ap = argparse.ArgumentParser(prog="launch.entry", description=__doc__)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--segment", type=int, default=1)
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument("--preflight-only", action="store_true")
    ap.add_argument("--checks", choices=("full", "env"), default="full", help="env: skip rank 0's Bridge re-audit")
    ap.add_argument("--claim", action="store_true", help="the plain-sbatch script's first step: record this job")
    args, extra = ap.parse_known_args(argv)
    if bad := [t for t in extra if "=" not in t or t.startswith("-")]:
        ap.error(f"unrecognised arguments: {' '.join(bad)} (run plugins add key=value overrides only)")
    args.plugin_sets = extra
    return args


def imports_only() -> int:
    """`entry.py --imports-only`: what this Python imports to train, imported as a rank does, nothing run; one line,
    exit 0 or 1 (make submit asks the job's Python this before it queues anything: cluster/submit.py)."""
    from overlapkit.bridge import stack

    try:
        stack.import_bridge()
        problem = stack.training_import_problem()
    except Exception as exc:  # whatever stops Bridge's import in this Python (a missing module, a mismatched one)
        problem = f"cannot import megatron.bridge: {preflight.missing(exc)}"
    print(f"imports: {problem}" if problem else preflight.IMPORTS_OK)
    return 1 if problem else 0


def main(argv=None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--imports-only"]:
        return imports_only()
    args = _args(argv)
    try:  # a refused claim or a broken plan.json: one line in the job's log naming the fix, no traceback
        if args.claim:
            return claim(args)
        plan = planfile.read_plan(args.run_dir)
    except BadInput as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    again = [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
    if not args.preflight_only and (code := profiled.wrap(args.run_dir, plan, again)) is not None:
        return code  # this rank ran under nsys, as nsys's child: the status of its training
    if (guard := resume_guard(args, plan)) is not None:
        return guard
    ledger = json.loads((args.run_dir / "ledger.json").read_text())
    rec = preflight.rank_checks(plan, ledger["values"], ledger.get("secrets", ()))
    rec["checkpoint_dir"] = run_options(args.run_dir).checkpoint_dir
    # this job's preflight records: a chain's segment-N/ (each segment's ranks must not read the records of the last)
    out = args.run_dir if args.segments == 1 else args.run_dir / f"segment-{args.segment}"
    (out / "preflight").mkdir(parents=True, exist_ok=True)
    write_json(out / "preflight" / f"rank-{rec['rank'] or 0:05d}.json", rec)
    if rec["failures"]:
        print(f"preflight failed on rank {rec['rank']}: " + "; ".join(rec["failures"]), file=sys.stderr)
    ok, rebuilt = rec["ok"], None
    if rec["rank"] == 0:
        rebuilt = rebuild(args) if args.checks == "full" else None  # built once: re-audited, then trained
        # rank 0's verdict: the re-audit (when rebuilt), every rank's record, and the run's preflight.json
        ranks = preflight.collect(out, rec["world_size"] or 1, timeout=120)
        verdict = preflight.summary(plan, rec, ranks, rebuilt, args.checks)
        write_json(out / "preflight.json", verdict)
        print(f"preflight: {'OK' if verdict['ok'] else 'FAILED'} ({len(ranks)}/{rec['world_size']} ranks)")
        ok = verdict["ok"]
    elif ok:
        # Wait for rank 0's verdict: srun ends a step 60 s (--wait) after the first task exits, and rank 0's
        # Bridge re-audit can take longer than that on a loaded node. All ranks then exit with the same verdict.
        ok = preflight.wait_for_summary(out / "preflight.json", timeout=900)
    if not ok:
        return 1
    if args.preflight_only:
        return 0
    cfg = (rebuilt or rebuild(args)).cfg  # first: rebuild imports Bridge (TE shim, offline)
    from overlapkit.bridge import stack

    forward_step, pretrain = stack.training_entry()

    if args.ckpt_step is not None:  # the resume guard's fallback: the tracker's iteration is incomplete
        cfg.checkpoint.ckpt_step = args.ckpt_step
    if not rec["rank"] and cfg.checkpoint.save:  # the layout this run saves with, beside its checkpoints
        resume.record_layout(cfg.checkpoint.save, plan["layout"], args.resume, os.environ.get("SLURM_JOB_ID"))
    started = time.time()  # a profiler's trace older than this is not this training's
    pretrain(cfg, forward_step)
    iters = (plan.get("run") or {}).get("train_iters")
    if rec["rank"] == 0 and iters:  # checkpoints at train_iters: the later segments would only start to exit
        done = resume.state(cfg.checkpoint.save, cfg.checkpoint.ckpt_format).named or 0
        for line in chain.cancel_after(args.run_dir, args.segment) if done >= iters else ():
            print(line)
    # no task may exit while a profiled rank still exports (srun --wait); TORCH_PROFILE: Bridge's trace kept, reported
    profiled.after_training(args.run_dir, plan, cfg.logger.tensorboard_dir, since=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
