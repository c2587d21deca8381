"""The stack's own start-up checks in the plan (issue 42): what Bridge's runtime_config_update and Core's config
post-inits raise or warn when the job starts is the plan's finding, with the stack's own message and where it came
from. The configs below are ones the earlier plan passed (audit OK) and the pinned stack rejects or degrades at job
start; expected messages are the stack's, read from its source (megatron/core/transformer/transformer_config.py,
model_parallel_config.py, optimizer/optimizer_config.py; megatron/bridge/training/config.py)."""

from __future__ import annotations

import os
import sys

import pytest

from overlapkit.bridge import build, startup
from overlapkit.spec.topology import Target

QWEN = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"
LLAMA8 = "llama3_8b_pretrain_8gpu_h100_bf16"
NCCLEP = "model.moe_flex_dispatcher_backend=ncclep model.moe_expert_rank_capacity_factor=2.0"


def _stack_findings(plan, code):
    return [f for f in plan.report.findings if f.code == code]


def test_the_issues_ncclep_example_fails_with_the_ep_row_off_and_the_stacks_reason():
    """Core 0.19.2 warns in TransformerConfig.__post_init__ that the EP overlap with ncclep and a dynamic shape does a
    device-to-host sync that serializes the 1F1B overlap: the claimed overlap is gone, so the row is off, with Core's
    words, and the plan fails."""
    plan = build.make_plan(QWEN, sets=NCCLEP)
    row = plan.report.row("ep_a2a_overlap")
    assert row.state == "off" and "serializes the 1F1B overlap" in row.detail
    assert "megatron.core.transformer.transformer_config" in row.detail
    (lost,) = _stack_findings(plan, "overlap_lost_at_start")
    assert lost.level == "error" and not plan.report.ok
    assert lost.fix == "model.moe_ncclep_static_shape=true"  # the field=value Core's message asks for
    assert "\n" not in lost.message


@pytest.mark.parametrize(
    "recipe, sets, where, said",
    [
        # Core: recompute_granularity=full needs a method (the earlier plan passed it).
        (
            LLAMA8,
            "model.recompute_granularity=full",
            "transformer_config:__post_init__",
            'must be "block" or "uniform"',
        ),
        # Bridge's validate: the model's and the dataset's sequence lengths must match (a SET of one of them).
        (LLAMA8, "model.seq_length=16384", "config:validate", "sequence length configuration in model config"),
        # Core's OptimizerConfig: the precision-aware optimizer is Adam only (the Qwen3 recipes use it).
        (QWEN, "optimizer.optimizer=sgd", "optimizer_config:__post_init__", "only supported with adam"),
        # Core: the ncclep backend is a flex-dispatcher backend.
        (
            QWEN,
            "model.moe_token_dispatcher_type=alltoall model.moe_flex_dispatcher_backend=ncclep",
            "transformer_config:__post_init__",
            "requires moe_token_dispatcher_type='flex'",
        ),
        # Core's NCCL EP manager: the receive buffer is sized by the capacity factor (its constructor's check).
        (
            QWEN,
            "model.moe_flex_dispatcher_backend=ncclep",
            "token_dispatcher:__init__",
            "requires moe_expert_rank_capacity_factor",
        ),
    ],
)
def test_a_config_the_stack_rejects_at_start_fails_the_plan_with_the_stacks_line(recipe, sets, where, said):
    plan = build.make_plan(recipe, sets=sets)
    (rejected,) = _stack_findings(plan, "stack_rejects")
    assert rejected.level == "error" and not plan.report.ok
    assert where in rejected.message and said in rejected.message and "\n" not in rejected.message


def test_the_fix_the_stack_names_is_a_set_that_clears_it():
    sets = "model.moe_token_dispatcher_type=alltoall model.moe_flex_dispatcher_backend=ncclep"
    (rejected,) = _stack_findings(build.make_plan(QWEN, sets=sets), "stack_rejects")
    assert rejected.fix == "model.moe_token_dispatcher_type=flex"
    fixed = build.make_plan(QWEN, sets=f"{sets} model.moe_expert_rank_capacity_factor=2.0 {rejected.fix}")
    assert not _stack_findings(fixed, "stack_rejects")


def test_a_dotted_fix_in_the_stacks_message_names_its_own_section():
    """Bridge's validate: "Set rerun_state_machine.check_for_nan_in_loss=False" (a section outside the model)."""
    plan = build.make_plan("llama3_70b_pretrain_64gpu_h100_bf16", sets="model.cuda_graph_impl=full_iteration")
    fixes = {f.fix for f in _stack_findings(plan, "stack_rejects")}
    assert fixes == {"rerun_state_machine.check_for_nan_in_loss=false"}


def test_every_shipped_recipe_starts_clean():
    """The shipped recipes pass the stack's own start-up checks for their layout (warnings allowed: the stack's)."""
    from overlapkit.bridge import registry

    for name in registry.names():
        plan = build.make_plan(name)
        assert not _stack_findings(plan, "stack_rejects") + _stack_findings(plan, "overlap_lost_at_start"), name


def test_a_warning_that_loses_no_overlap_is_a_warning():
    """Core warns about many experts without fp32 routing: worth seeing, no overlap lost, the audit stays OK."""
    plan = build.make_plan("qwen3_235b_a22b_pretrain_256gpu_h100_bf16")
    said = [f for f in _stack_findings(plan, "stack_warns") if "fp32 routing" in f.message]
    assert said and said[0].level == "warning" and plan.report.ok


def test_the_targets_transformer_engine_is_the_one_checked():
    """A cluster whose container has an older TE: Core's version gates answer for that TE, not for this machine's
    (none) nor for the lock's. Core 0.19.2 refuses FP8 grouped-GEMM MoE below TE 1.11."""
    plan = build.make_plan("qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs")
    old = Target(nodes=plan.target.nodes, te_version="1.10.0")
    said = startup.check(plan.cfg, old, plan.resolved)
    assert said.raised and "1.11" in said.raised[1] and "transformer_config" in said.raised[0]
    assert startup.check(plan.cfg, plan.target, plan.resolved).raised is None


def test_the_check_leaves_the_process_as_it_found_it():
    """The mocks (the target's TE and GPU, WORLD_SIZE) last for the check only: the plan server plans the next
    request in the same interpreter."""
    import torch
    from megatron.core import utils as core_utils
    from megatron.core.transformer.moe import moe_utils

    plan = build.make_plan(QWEN, sets=NCCLEP)
    env, mods = dict(os.environ), set(sys.modules)
    te, cap, permute = core_utils._te_version, torch.cuda.get_device_capability, moe_utils.fused_permute
    startup.check(plan.cfg, plan.target, plan.resolved)
    assert dict(os.environ) == env and "WORLD_SIZE" not in os.environ
    assert "transformer_engine" not in sys.modules and set(sys.modules) <= mods
    assert (core_utils._te_version, torch.cuda.get_device_capability, moe_utils.fused_permute) == (te, cap, permute)
    assert plan.cfg.model.gradient_accumulation_fusion is False  # the plan's own config untouched (this CPU's answer)


def test_the_optimizer_step_gather_with_a_full_iteration_graph_fails(tmp_path):
    """Megatron-Bridge #5788: the gather the optimizer step starts lies outside the captured iteration and the
    capture fails. Bridge 0.6.2's validate does not refuse it (only its perf scripts guard it); the audit does, with
    Bridge's own full-iteration predicate."""
    sets = "overlap.param_gather_with_optimizer_step=true model.cuda_graph_impl=full_iteration"
    plan = build.make_plan(
        "llama3_70b_pretrain_64gpu_h100_bf16", sets=sets + " rerun_state_machine.check_for_nan_in_loss=false"
    )
    (err,) = [f for f in plan.report.errors if f.code == "opt_step_with_full_iteration_graph"]
    assert "#5788" in err.message and err.fix == "overlap.param_gather_with_optimizer_step=false"
    assert build.make_plan(
        "llama3_70b_pretrain_64gpu_h100_bf16", sets=sets.split()[1] + " rerun_state_machine.check_for_nan_in_loss=false"
    ).report.ok


def test_ep_overlap_on_one_hardware_queue_is_a_warning():
    """Megatron-LM #2719: the 1F1B EP overlap under CUDA_DEVICE_MAX_CONNECTIONS=1 (kept for CP overlap) hides less."""
    plan = build.make_plan(QWEN, sets="model.context_parallel_size=2")
    (said,) = [f for f in plan.report.warnings if f.code == "ep_overlap_one_queue"]
    assert "#2719" in said.message
    assert not [f for f in build.make_plan(QWEN).report.warnings if f.code == "ep_overlap_one_queue"]


@pytest.mark.parametrize(
    "sets, code",
    [
        ("model.moe_token_dispatcher_type=allgather", "ep_overlap_dispatcher"),
        ("model.recompute_granularity=full model.recompute_method=uniform", "ep_overlap_full_recompute"),
        ("model.recompute_modules=[moe]", "ep_overlap_recompute_moe"),
        ("model.moe_shared_expert_overlap=true", "ep_overlap_shared_expert"),
        ("model.mtp_num_layers=2", "ep_overlap_mtp"),
    ],
)
def test_the_restated_ep_overlap_rules_agree_with_bridges_asserts(sets, code):
    """bridge/moe.py keeps Bridge's EP-overlap prerequisites only for the one-key fix Bridge's bare asserts lack: on
    the same input, ours names the rule and Bridge's own setup (run by the resolve) asserts."""
    plan = build.make_plan(QWEN, sets=sets)
    assert code in plan.report.codes("error") and plan.resolved.bridge_asserts, plan.report.codes("error")
    shipped = build.make_plan(QWEN)
    assert not shipped.resolved.bridge_asserts and not {c for c in shipped.report.codes() if c.startswith("ep_")}


def test_the_ncclep_backend_is_named_where_the_model_does_not_price_it():
    plan = build.make_plan(QWEN, sets=NCCLEP)
    assert any(k.setting == "model.moe_flex_dispatcher_backend=ncclep" for k in plan.not_modelled)
    assert not any("ncclep" in k.setting for k in build.make_plan(QWEN).not_modelled)
