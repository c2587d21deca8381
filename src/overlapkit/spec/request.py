"""The request a plan is made from: what the user typed, parsed once (bridge/request.py) and bound once, then
passed down as plain data.

The request carries the cluster it runs on when the caller resolved one (make plan's CLUSTER, before the import: a
`Cluster`, the profile's facts as plain values, resolved by the entry); `bind` is the one home of binding the run
options to it (its job directory, the per-segment time limit, its W&B project): bridge/build.py `plan_for` binds a
request that carries a cluster, where the recipe's own time limit is known, and make submit/sbatch and the nightly
bind through launch/submit.py. The plan, its run directory's overrides.json and the job's rebuild
(bridge/request.py `from_record`) all carry the same bound request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from overlapkit.errors import BadInput
from overlapkit.spec import runopts
from overlapkit.spec.topology import DEFAULT_GPU


@dataclass(frozen=True)
class Cluster:
    """Where a request runs, as its caller resolved it from the cluster profile (cluster.profiles.ClusterProfile's
    fields of the same names, its job directory made absolute): plan/ only reads these. A cluster named only (its
    calibration: make new-recipe) has no job directory."""

    name: str
    source: str = ""  # the profile's file, named in messages
    job_path: str = ""  # the shared job directory, absolute: checkpoints live under it
    time_limit: str | None = None  # per segment; None: the recipe's
    wandb_project: str | None = None
    wandb_entity: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # network env (NCCL_IB_HCA, ...)
    secrets: tuple[str, ...] = ()  # names only
    laid_out: bool = False  # the job's env is laid out on it (make submit): env and secrets in the ledger


@dataclass(frozen=True)
class PlanRequest:
    recipe: str
    nodes: int | None = None  # None: the recipe's
    sets: tuple[tuple[str, str], ...] = ()  # the SET pairs as typed: (key, raw text)
    run: runopts.RunOptions = runopts.RunOptions()  # bound: job_dir, time_limit_min, wandb filled in by the binder
    gpu: str = DEFAULT_GPU  # GPU=: the HARDWARE entry memory and throughput are sized for
    # The cluster plan_for binds the run options to (its name picks the calibration); None for no cluster (the job's
    # rebuild, whose run options were bound at submit; tests)
    cluster: Cluster | None = None


def bind(req: PlanRequest, where: Cluster, recipe_time_limit: str | None) -> PlanRequest:
    """The request on this cluster: its job directory, the per-segment time limit (the profile's, else the
    recipe's), its W&B project. A chained run needs a limit longer than its save window."""
    limit = runopts.minutes(where.time_limit or recipe_time_limit or "") or None
    window = runopts.GUARD_MIN + runopts.PREEMPT_S // 60
    if req.run.segments > 1 and limit is not None and limit <= window:
        raise BadInput(
            f"SEGMENTS needs a time limit above {window} minutes (the save window): {where.source} has {limit}"
        )
    wandb = {"project": where.wandb_project, "entity": where.wandb_entity} if where.wandb_project else None
    run = dataclasses.replace(req.run, job_dir=str(where.job_path), time_limit_min=limit, wandb=wandb)
    return dataclasses.replace(req, run=run)
