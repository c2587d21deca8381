"""The request a plan is made from: what the user typed, parsed once and bound once, then passed down as plain data.

`parse` checks everything that can be checked before the Bridge import (NODES, the recipe's name, SET's syntax, keys,
types and sizes, RUN_NAME, SEGMENTS, NSYS, DATA): one line per bad value. The request carries the cluster it runs on
when the caller resolved one (make plan's CLUSTER, before the import: a `Cluster`, the profile's facts as plain
values, resolved by the entry: plan/ reads them and never calls into cluster/, a later stage); `bind` is the one home
of binding the run options to it (its job directory, the per-segment time limit, its W&B project): bridge/build.py
`plan_for` binds a request that carries a cluster, where the recipe's own time limit is known, and
overlapkit.cluster.submit binds through it for make submit/sbatch and the nightly. The plan, its run directory's
overrides.json and the job's rebuild (`from_record`) all carry the same bound request.

Standard library only at import: the pre-import checks must answer in well under a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from overlapkit.bridge import runopts
from overlapkit.errors import BadInput
from overlapkit.sizing import hardware


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
    gpu: str = hardware.DEFAULT_GPU  # GPU=: the HARDWARE entry memory and throughput are sized for
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


def parse(
    recipe: str,
    nodes: str = "",
    sets: str = "",
    run: dict | None = None,
    *,
    listing: bool = False,
    action: str = "plan",
    gpu: str = "",
) -> PlanRequest:
    """The typed request, every pre-import check made (in this order: NODES, the recipe's name, SET, the run
    options). `run`: the run options' text by runopts.parse's keywords (run_name, segments, nsys, nsys_ranks, data);
    None leaves them out of the check (make overlap-report: a run that has been). `listing`: `make recipes`,
    which names no recipe. `gpu`: GPU= as typed (empty: h100)."""
    from overlapkit.bridge import inputs, registry

    count = inputs.parse_nodes(nodes)
    chip = hardware.parse_gpu(gpu)
    if not listing:
        if not recipe:
            raise BadInput(f"no recipe given: make {action} RECIPE=<name> (make recipes lists them)")
        registry.check_declared(recipe)
    pairs = inputs.check_sets(sets)
    opts = runopts.RunOptions() if run is None else runopts.parse(**run)  # None: not even DATA's module is imported
    return PlanRequest(recipe, count, tuple(pairs), opts, chip)


def loose(
    name: str,
    nodes: int | None = None,
    sets=None,
    run: runopts.RunOptions | None = None,
    gpu: str = hardware.DEFAULT_GPU,
) -> PlanRequest:
    """A request from values a caller already holds (tests, listings, forks): SET as text or KEY=VALUE tokens."""
    from overlapkit.bridge import overrides

    return PlanRequest(name, nodes, tuple(overrides.parse(sets)), run or runopts.RunOptions(), hardware.parse_gpu(gpu))


def from_record(rec: dict, recipe: str, nodes: int | None, extra_sets=()) -> PlanRequest:
    """The request again in the job, from the run directory's overrides.json (its run options already bound) and the
    run plugins' KEY=VALUE overrides after the typed ones."""
    sets = [f"{k}={v}" for k, v in rec["set"]] + list(extra_sets)
    gpu = rec.get("gpu", hardware.DEFAULT_GPU)  # a record from before GPU= was planned for the default
    return loose(recipe, nodes, sets, runopts.RunOptions.from_dict(rec["run"]), gpu=gpu)
