"""A submitted run's jobs, one per segment (SEGMENTS=N: afterany chain): their states, the last checkpointed
iteration, and cancelling what has not ended. `make status` and `make cancel` read a run directory through here."""

from __future__ import annotations

import json
from pathlib import Path

from overlapkit.cluster import slurm
from overlapkit.plan import runopts


def job_ids(info: dict) -> list[str]:
    """Every job of a submission, in segment order (a run submitted before chains has one)."""
    return list(info.get("job_ids") or [info["job_id"]])


def status_lines(run_dir: Path, info: dict) -> list[str]:
    """One line per segment (job, Slurm state), then the checkpoint: directory and last saved iteration."""
    ids = job_ids(info)
    out = []
    for i, job in enumerate(ids, 1):
        state = slurm.job_state(job)
        label = f"segment {i}/{len(ids)}: job {job} {state}" if len(ids) > 1 else f"job {job} {state}"
        pre = run_dir / (f"segment-{i}" if len(ids) > 1 else "") / "preflight.json"
        if pre.is_file():
            label += f"; preflight {'OK' if json.loads(pre.read_text()).get('ok') else 'FAILED'}"
        out.append(label)
    ckdir = info.get("checkpoint_dir")
    if ckdir:
        found, step = runopts.checkpoint_state(ckdir)
        iters = (json.loads((run_dir / "plan.json").read_text()).get("run") or {}).get("train_iters")
        last = f"iteration {step}" + (f" of {iters}" if iters else "") if step is not None else "none yet"
        out.append(
            f"checkpoints: {ckdir}; last checkpointed {last}" + ("" if found or step is None else " (tracker missing)")
        )
    return out


def cancel(info: dict) -> list[str]:
    """Cancel every job of the chain that has not ended; one line per job saying what became of it."""
    out = []
    for job in job_ids(info):
        ended = slurm.cancel(job)
        out.append(f"job {job}: already {ended}: nothing to cancel" if ended else f"job {job}: cancelled")
    return out
