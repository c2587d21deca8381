"""The in-job preflight of launch/entry.py: each rank's checks of its environment against the ledger and the plan,
rank 0's re-audit of the recipe rebuilt in the job, and the waits that hand all ranks rank 0's verdict. Standard
library only: it runs before torch, since the ledger's launch-time variables must be set before CUDA initialises."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from overlapkit.spec.runopts import NSYS_FIX
from overlapkit.spec.topology import env_int


def rank_checks(plan: dict, ledger: dict[str, str], secrets=(), environ=os.environ) -> dict:
    """Cheap checks every rank runs; returns this rank's record (secrets: present or not, never their values)."""
    lay = plan["layout"]
    notes, seen = [], {name: environ.get(name) for name in ledger}
    failures = [
        f"{name}={seen[name]!r} but the ledger says {want!r}" for name, want in ledger.items() if seen[name] != want
    ]
    unset = [name for name in secrets if not environ.get(name)]
    failures += [f"secret {name} is not in the job environment: export it in the submitting shell" for name in unset]
    if "torch" in sys.modules:  # nothing imported torch before the env check: CUDA cannot have been initialised
        failures.append("torch was imported before the preflight: the ledger's launch-time variables may be too late")
    rank = env_int("SLURM_PROCID", "RANK", environ=environ)
    world = env_int("SLURM_NTASKS", "WORLD_SIZE", environ=environ)
    local = env_int("SLURM_LOCALID", "LOCAL_RANK", environ=environ)
    nnodes = env_int("SLURM_NNODES", "NNODES", environ=environ)
    if world != lay["gpus"]:
        failures.append(f"world size {world} != planned {lay['gpus']} GPUs")
    if nnodes is not None and nnodes != lay["nodes"]:
        failures.append(f"{nnodes} nodes != planned {lay['nodes']}")
    if rank is None or world is None or not 0 <= rank < world:
        failures.append(f"rank {rank} outside world size {world}")
    if local is None or not 0 <= local < 8:
        failures.append(f"local rank {local} outside 0..7 (8 GPUs per node)")
    tp_on = plan["audit"]["rows"]["tp_comm_overlap"]["state"] == "on"
    gpu_node, gpu_only = Path("/dev/nvidiactl").exists(), []  # what only a GPU node must have: a note on a CPU one
    if tp_on and importlib.util.find_spec("transformer_engine") is None:
        gpu_only.append("Transformer Engine is not importable but TP overlap is on")
    nsys = (plan.get("run") or {}).get("nsys")
    if nsys and rank in nsys["ranks"] and shutil.which("nsys", path=environ.get("PATH", "")) is None:
        gpu_only.append(f"NSYS profiles rank {rank} but nsys is not on the PATH: {NSYS_FIX}")  # else the wrap fails
    for msg in gpu_only:
        (failures if gpu_node else notes).append(msg + ("" if gpu_node else " (CPU node: dry run, not fatal)"))
    if tp_on and not any(k in environ for k in ("PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        failures.append("TP overlap's userbuffers bootstrap needs MPI/PMIx ranks: launch with `srun --mpi=pmix`")
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


def until(ready, timeout: float, every: float = 0.5):
    """`ready()`'s first true answer, asked every `every` s for up to `timeout` s; its last (false) one after that."""
    deadline = time.monotonic() + timeout
    while not (got := ready()) and time.monotonic() < deadline:
        time.sleep(every)
    return got


def collect(run_dir: Path, world: int, timeout: float) -> list[dict]:
    until(lambda: len(list((run_dir / "preflight").glob("rank-*.json"))) >= world, timeout)
    return [json.loads(f.read_text()) for f in sorted((run_dir / "preflight").glob("rank-*.json"))]


def wait_for_summary(path: Path, timeout: float) -> bool:
    if until(path.exists, timeout):
        return bool(json.loads(path.read_text())["ok"])
    print(f"preflight: no verdict from rank 0 in {timeout:.0f} s ({path})", file=sys.stderr)
    return False


def summary(plan: dict, rec: dict, ranks: list[dict], rebuilt, checks: str) -> dict:
    """Rank 0's verdict for the job's preflight.json: its own record, every rank's, and the re-audit (when rebuilt)."""
    errors = []
    if rebuilt is not None:  # does the recipe rebuilt in the job still audit as the submitted plan said?
        again = rebuilt.to_dict()
        errors = [f"re-audit error: {e['message']}" for e in again["audit"]["errors"]]
        if again["layout"] != plan["layout"] or again["audit"]["rows"] != plan["audit"]["rows"]:
            errors.append("the recipe rebuilt in the job differs from the submitted plan (code changed since submit?)")
    bad = [r["rank"] for r in ranks if not r["ok"]]
    return {
        "ok": rec["ok"] and not errors and not bad and len(ranks) == rec["world_size"],
        "checks": checks,
        "ranks_reported": len(ranks),
        "world_size": rec["world_size"],
        "failed_ranks": bad,
        "reaudit_errors": errors,
        "hosts": sorted({r["host"] for r in ranks}),
        "checkpoint": {"save": rebuilt.cfg.checkpoint.save, "load": rebuilt.cfg.checkpoint.load} if rebuilt else None,
    }


IMPORTS_OK = "imports: OK"  # what launch/entry.py --imports-only prints when the training imports load


def missing(exc: Exception) -> str:
    """What stopped an import, in a few words: the module missing, else the error itself."""
    if isinstance(exc, ImportError) and exc.name:
        return f"module {exc.name!r} is not installed"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
