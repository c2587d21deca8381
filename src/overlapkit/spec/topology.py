"""Where a run executes, in numbers: GPUs per node, the planned target, a layout (how a model is split over the GPUs and
batched) and the data parallelism it leaves.

The one home of GPUS_PER_NODE and DEFAULT_GPU: an H100 SXM node (DGX/HGX H100) has 8 GPUs on one NVLink switch, so
tensor parallelism stays inside it and every node count is a multiple of 8 GPUs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from overlapkit.errors import BadInput

GPUS_PER_NODE = 8
# The launch variable the plan pins (its rule: bridge/env.py connections), named in the overlap report's fixes too.
PINNED = "CUDA_DEVICE_MAX_CONNECTIONS"
DEFAULT_GPU = "h100"  # what every recipe was written and published for (its name says so; sizing/hardware.py's rows)


def env_int(*names: str, environ=os.environ) -> int | None:
    """Which rank this process is, and of how many: the first of `names` set to a whole number (Slurm's variable,
    then torchrun's), else None."""
    # ASCII digits: "²".isdigit() holds, int("²") fails
    return next((int(environ[n]) for n in names if re.fullmatch(r"[0-9]{1,9}", environ.get(n, ""))), None)


class LayoutError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class Layout:
    """The one layout type: a recipe's (recipes/_base.py), a published run's (bridge/published.py), a 1-GPU cut's
    (bridge/gpucut.py)."""

    tp: int
    pp: int
    cp: int
    vpp: int | None  # None: no interleaving
    mbs: int
    gbs: int
    seq: int | None = None  # None: keep the base recipe's sequence length
    ep: int = 1  # expert parallelism (MoE models)
    etp: int | None = None  # expert tensor parallelism; None: keep the base recipe's


@dataclass(frozen=True)
class Target:
    """Where the run will execute. TE availability is a property of the target's container, not of this machine."""

    nodes: int
    gpus_per_node: int = GPUS_PER_NODE
    gpu: str = DEFAULT_GPU
    te_available: bool = True
    te_version: str | None = None  # the container's TE when known (cluster profile); None: new enough, unchecked

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def data_parallel_size(cfg, world_size: int) -> int:
    """DP = world / (TP·PP·CP); LayoutError (one line, with the fix) when the GPUs do not divide."""
    m = cfg.model
    mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * (m.context_parallel_size or 1)
    if world_size % mp:
        raise LayoutError(
            f"{world_size} GPUs do not divide by TP·PP·CP = {m.tensor_model_parallel_size}·"
            f"{m.pipeline_model_parallel_size}·{m.context_parallel_size or 1} = {mp}: use a node count whose "
            f"GPU total is a multiple of {mp}"
        )
    return world_size // mp


def expert_data_parallel_size(model, world_size: int) -> int:
    """Expert-data-parallel size: the expert side of the world is ETP·EP·PP·expert-DP (Megatron Core's expert grid
    folds CP into expert-DP)."""
    side = (model.expert_tensor_parallel_size or 1) * (model.expert_model_parallel_size or 1)
    return max(1, world_size // (side * model.pipeline_model_parallel_size))


def expert_group(ep: int, etp: int = 1, gpus_per_node: int = GPUS_PER_NODE) -> tuple[int, int]:
    """(EP ranks per node, nodes) of one expert-parallel group. Megatron Core lays the expert grid out tp-ep-dp-pp
    (megatron/core/parallel_state.py, the expert RankGenerator), so an EP group's members are ETP ranks apart: a node
    holds gpus_per_node/ETP of them and the group fills ceil(EP / that) nodes."""
    per_node = max(1, min(ep, gpus_per_node // etp))
    return per_node, -(-ep // per_node)
