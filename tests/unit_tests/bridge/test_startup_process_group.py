"""The start-up check's verdict does not depend on the planning process: a process group alive in it (a one-rank
gloo group, as the 1-GPU model tests make) once made Bridge's get_world_size_safe answer 1 instead of the target's
world, and the MoE recipes whose TP·PP·CP does not divide 1 failed their audit ("world size (1) is not divisible")
for as long as the plan was cached."""

from __future__ import annotations

import pytest

from overlapkit.bridge.build import make_plan


@pytest.mark.parametrize("name", ["deepseek_v3_pretrain_1024gpu_h100_bf16", "llama3_70b_pretrain_64gpu_h100_bf16"])
def test_a_process_group_in_the_planning_process_does_not_change_the_audit(name, one_rank):
    import torch

    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    plan = make_plan(name, caller_env={})
    assert plan.report.ok, [f.message for f in plan.report.errors]
