"""The in-job entry point: what every rank runs.

1. Preflight, on every rank, with the standard library only (64 ranks × a 1.3 GB Bridge import cannot work on a
   small node, and the checks must run before anything initialises CUDA): the process environment holds exactly
   the ledger's values (CUDA_DEVICE_MAX_CONNECTIONS in particular must come from the launcher: read at CUDA init,
   setting it from Python later does nothing), Slurm's world size/ranks match the plan, Transformer Engine is
   importable where TP overlap is on (on GPU nodes), and userbuffers can bootstrap (PMIx from `srun --mpi=pmix`).
   Each rank writes `preflight/rank-NNNNN.json` into the run directory.
2. Rank 0 (with `--checks full`) also rebuilds the recipe by name with the same overrides, re-audits it, checks the
   audit still matches the submitted plan, and writes `preflight.json` with every rank's result.
3. Every rank of a segment after the first (SEGMENTS=N) checks the run's checkpoint tracker: none is an error (exit 1,
   never a silent start from iteration 0: Bridge's `exit_on_missing_checkpoint` ends with status 0), and a run
   already at train_iters exits 0 without training.
4. Unless `--preflight-only`: Bridge's `pretrain(cfg, forward_step)` with the GPT forward step. With NSYS=a:b, a
   profiled rank first starts itself again under `nsys profile` and exports the report when it ends; the first
   profiled rank then writes overlap.json, and every rank waits for it (overlapkit/regress/profiled.py).

It runs as a path-based script (`python launch/entry.py ...`), so Bridge's run plugins (PreemptionPlugin) work
unchanged: their `key=value` overrides arrive as extra arguments and are applied after the run directory's
overrides.json (the SET pairs exactly as typed, and the run options).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# A path-based script: its own checkout's src/ and root on the path, whatever the launcher's PYTHONPATH.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(_ROOT / "src"), str(_ROOT)) if p not in sys.path]

from overlapkit.jsonio import write_json  # noqa: E402  (standard library only: safe before the environment check)
from overlapkit.plan import runopts  # noqa: E402  (standard library only at import)
from overlapkit.regress import profiled  # noqa: E402  (standard library only at import)


def _env_int(*names: str) -> int | None:
    for n in names:
        if os.environ.get(n, "").isdigit():
            return int(os.environ[n])
    return None


def rank_checks(plan: dict, ledger: dict[str, str], secrets=(), environ=os.environ) -> dict:
    """Cheap checks every rank runs; returns this rank's record (secrets: present or not, never their values)."""
    lay = plan["layout"]
    failures, notes = [], []
    seen = {name: environ.get(name) for name in ledger}
    for name, want in ledger.items():
        if environ.get(name) != want:
            failures.append(f"{name}={environ.get(name)!r} but the ledger says {want!r}")
    for name in secrets:
        if not environ.get(name):
            failures.append(f"secret {name} is not in the job environment: export it in the submitting shell")
    if "torch" in sys.modules:  # nothing imported torch before the env check: CUDA cannot have been initialised
        failures.append("torch was imported before the preflight: CUDA_DEVICE_MAX_CONNECTIONS may be too late")
    rank, world = _env_int("SLURM_PROCID", "RANK"), _env_int("SLURM_NTASKS", "WORLD_SIZE")
    local, nnodes = _env_int("SLURM_LOCALID", "LOCAL_RANK"), _env_int("SLURM_NNODES", "NNODES")
    if world != lay["gpus"]:
        failures.append(f"world size {world} != planned {lay['gpus']} GPUs")
    if nnodes is not None and nnodes != lay["nodes"]:
        failures.append(f"{nnodes} nodes != planned {lay['nodes']}")
    if rank is None or world is None or not 0 <= rank < world:
        failures.append(f"rank {rank} outside world size {world}")
    if local is None or not 0 <= local < 8:
        failures.append(f"local rank {local} outside 0..7 (8 GPUs per node)")
    tp_on = plan["audit"]["rows"]["tp_comm_overlap"]["state"] == "on"
    gpu_node = Path("/dev/nvidiactl").exists()
    if tp_on and importlib.util.find_spec("transformer_engine") is None:
        msg = "Transformer Engine is not importable but TP overlap is on"
        (failures if gpu_node else notes).append(msg + ("" if gpu_node else " (CPU node: dry run, not fatal)"))
    if tp_on and not any(k in environ for k in ("PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        failures.append("TP overlap's userbuffers bootstrap needs MPI/PMIx ranks: launch with `srun --mpi=pmix`")
    if problem := profiled.preflight(plan, rank):
        (failures if gpu_node else notes).append(problem + ("" if gpu_node else " (CPU node: dry run, not fatal)"))
    return {
        "rank": rank,
        "local_rank": local,
        "world_size": world,
        "nodes": nnodes,
        "host": os.uname().nodename,
        "slurm_job_id": environ.get("SLURM_JOB_ID"),
        "env": seen,
        "launcher_vars": sorted(k for k in environ if k.startswith(("PMIX_", "PMI_", "OMPI_", "SLURM_MPI"))),
        "ok": not failures,
        "failures": failures,
        "notes": notes,
    }


def reaudit(plan: dict, rebuilt) -> list[str]:
    """Rank 0: does the recipe rebuilt in the job (an overlapkit Plan) still audit as the submitted plan said?"""
    again = rebuilt.to_dict()
    out = [f"re-audit error: {e['message']}" for e in again["audit"]["errors"]]
    if again["layout"] != plan["layout"] or again["audit"]["rows"] != plan["audit"]["rows"]:
        out.append("the recipe rebuilt in the job differs from the submitted plan (code changed since submit?)")
    return out


def rebuild(args):
    """The recipe planned again in the job from overrides.json, then the plugins' overrides (imports Bridge: after
    the preflight). A job that trains imports the whole stack first: nothing deferred (overlapkit/lazy_imports.py)
    where it trains, as a preflight-only job plans with it deferred."""
    from overlapkit import stack

    stack.import_bridge(full=not args.preflight_only)
    from overlapkit.plan import request
    from overlapkit.plan.build import OVERRIDES, plan_for

    rec = json.loads((args.run_dir / OVERRIDES).read_text())
    return plan_for(request.from_record(rec, args.recipe, args.nodes, args.plugin_sets))  # bound at submit


def resume_guard(args, plan: dict) -> int | None:
    """A later segment must resume: no checkpoint tracker → 1 with the reason; training already finished → 0."""
    run = plan.get("run") or {}
    found, step = runopts.checkpoint_state(run.get("checkpoint_dir"))
    where = f"segment {args.segment}/{args.segments}"
    say = print if not _env_int("SLURM_PROCID", "RANK") else (lambda *a, **k: None)  # rank 0 speaks for all
    if args.segment > 1 and not found:
        say(
            f"error: {where}: no checkpoint to resume from in {run.get('checkpoint_dir')} (no "
            f"{' or '.join(runopts.TRACKERS)}): the previous segment saved none; refusing to start from iteration "
            "0 (make status shows what each segment did)",
            file=sys.stderr,
        )
        return 1
    if step is not None and run.get("train_iters") and step >= run["train_iters"]:
        say(f"{where}: training finished at iteration {step} (train_iters {run['train_iters']}): nothing to run")
        return 0
    if found:
        say(f"{where}: resuming from iteration {step} in {run['checkpoint_dir']}")
    return None


def checkpoint_dir(run_dir: Path) -> str | None:
    """Where this rank's config saves and loads checkpoints: overrides.json's run options (what rebuild applies)."""
    rec = json.loads((run_dir / "overrides.json").read_text())
    return runopts.RunOptions.from_dict(rec.get("run")).checkpoint_dir


def out_dir(args) -> Path:
    """Where this job's preflight records go: the run directory, or segment-N/ in it for a chain (each segment's
    ranks must not read the records of the one before)."""
    return args.run_dir if args.segments == 1 else args.run_dir / f"segment-{args.segment}"


def collect(run_dir: Path, world: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    files = []
    while time.monotonic() < deadline:
        files = sorted((run_dir / "preflight").glob("rank-*.json"))
        if len(files) >= world:
            break
        time.sleep(0.5)
    return [json.loads(f.read_text()) for f in files]


def wait_for_summary(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return bool(json.loads(path.read_text())["ok"])
        time.sleep(0.5)
    print(f"preflight: no verdict from rank 0 in {timeout:.0f} s ({path})", file=sys.stderr)
    return False


def _args(argv):
    ap = argparse.ArgumentParser(prog="launch.entry", description=__doc__)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--segment", type=int, default=1)
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument("--preflight-only", action="store_true")
    ap.add_argument("--checks", choices=("full", "env"), default="full", help="env: skip rank 0's Bridge re-audit")
    args, extra = ap.parse_known_args(argv)
    if bad := [t for t in extra if "=" not in t or t.startswith("-")]:
        ap.error(f"unrecognised arguments: {' '.join(bad)} (run plugins add key=value overrides only)")
    args.plugin_sets = extra
    return args


def rank0_verdict(args, plan: dict, rec: dict, rebuilt) -> bool:
    """Rank 0: the re-audit (when rebuilt), every rank's record, and the run's preflight.json."""
    errors = reaudit(plan, rebuilt) if rebuilt is not None else []
    ranks = collect(out_dir(args), rec["world_size"] or 1, timeout=120)
    bad = [r["rank"] for r in ranks if not r["ok"]]
    summary = {
        "ok": rec["ok"] and not errors and not bad and len(ranks) == rec["world_size"],
        "checks": args.checks,
        "ranks_reported": len(ranks),
        "world_size": rec["world_size"],
        "failed_ranks": bad,
        "reaudit_errors": errors,
        "hosts": sorted({r["host"] for r in ranks}),
        "checkpoint": {"save": rebuilt.cfg.checkpoint.save, "load": rebuilt.cfg.checkpoint.load} if rebuilt else None,
    }
    write_json(out_dir(args) / "preflight.json", summary)
    print(f"preflight: {'OK' if summary['ok'] else 'FAILED'} ({len(ranks)}/{rec['world_size']} ranks)")
    return summary["ok"]


def main(argv=None) -> int:
    args = _args(argv)
    plan = json.loads((args.run_dir / "plan.json").read_text())
    rank, again = _env_int("SLURM_PROCID", "RANK"), sys.argv[1:] if argv is None else argv
    if not args.preflight_only and profiled.profiles_rank(args.run_dir, plan, rank):
        return profiled.run_profiled(args.run_dir, rank, plan, [sys.executable, str(_ROOT / "launch/entry.py"), *again])
    if (guard := resume_guard(args, plan)) is not None:
        return guard
    ledger = json.loads((args.run_dir / "ledger.json").read_text())
    rec = rank_checks(plan, ledger["values"], ledger.get("secrets", ()))
    rec["checkpoint_dir"] = checkpoint_dir(args.run_dir)
    (out_dir(args) / "preflight").mkdir(parents=True, exist_ok=True)
    write_json(out_dir(args) / "preflight" / f"rank-{rec['rank'] or 0:05d}.json", rec)
    if rec["failures"]:
        print(f"preflight failed on rank {rec['rank']}: " + "; ".join(rec["failures"]), file=sys.stderr)
    ok, rebuilt = rec["ok"], None
    if rec["rank"] == 0:
        rebuilt = rebuild(args) if args.checks == "full" else None  # built once: re-audited, then trained
        ok = rank0_verdict(args, plan, rec, rebuilt)
    elif ok:
        # Wait for rank 0's verdict: srun ends a step 60 s (--wait) after the first task exits, and rank 0's
        # Bridge re-audit can take longer than that on a loaded node. All ranks then exit with the same verdict.
        ok = wait_for_summary(out_dir(args) / "preflight.json", timeout=900)
    if not ok:
        return 1
    if args.preflight_only:
        return 0
    cfg = (rebuilt or rebuild(args)).cfg  # first: rebuild imports Bridge in full (TE shim, offline, nothing deferred)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, forward_step)
    profiled.after_training(args.run_dir, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
