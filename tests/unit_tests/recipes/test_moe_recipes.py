"""The eight MoE recipes against NVIDIA's H100 perf recipe of the same name, field by field (layout, MoE knobs, the
overlaps Bridge resolves, precision, launch environment), and their HF configs against the providers Bridge builds.

Every difference must be listed in DELIBERATE with its reason; a new difference (a Bridge upgrade that retunes a perf
recipe, or an edit here) fails until it is matched or listed.
"""

from __future__ import annotations

import importlib
import json

import pytest

from overlapkit import paths
from overlapkit.bridge import registry
from overlapkit.bridge.build import make_plan
from overlapkit.bridge.overlap import resolve
from overlapkit.spec.topology import Target

MOE = [
    f"{m}_pretrain_{g}gpu_h100_{d}"
    for m, g in [("qwen3_30b_a3b", 16), ("qwen3_235b_a22b", 256), ("deepseek_v3", 1024), ("gpt_oss_120b", 64)]
    for d in ("bf16", "fp8cs")
]
MODEL = (
    "tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size "
    "virtual_pipeline_model_parallel_size expert_model_parallel_size expert_tensor_parallel_size sequence_parallel "
    "seq_length pipeline_model_parallel_layout num_moe_experts moe_router_topk moe_token_dispatcher_type "
    "moe_flex_dispatcher_backend moe_hybridep_num_sms moe_shared_expert_overlap moe_router_fusion "
    "moe_router_force_load_balancing moe_permute_fusion moe_grouped_gemm recompute_granularity recompute_modules "
    "recompute_method recompute_num_layers mtp_num_layers bias_activation_fusion apply_rope_fusion "
    "cross_entropy_fusion_impl cuda_graph_impl"
).split()
RESOLVED = "tp_comm_overlap overlap_p2p_comm overlap_moe_expert_parallel_comm delay_wgrad_compute".split()
PRECISION = "bf16 fp8 fp8_recipe fp8_param_gather first_last_layers_bf16 grad_reduce_in_fp32".split()

_FORCE = (
    "forces uniform routing whatever the router scores: a benchmark device that makes step time independent of "
    "routing imbalance; a training recipe routes by the learned router (expect the published step time as a best case)"
)
_P2P_CHUNK = (
    "derived for every PP>1 layout (bridge/env.py, from NVIDIA's Llama3 70B recipe); the MoE perf recipes omit it"
)
# (recipe, field) → why our recipe differs from NVIDIA's perf recipe. "*" matches every MoE recipe.
DELIBERATE = {
    ("*", "model.moe_router_force_load_balancing"): _FORCE,
    ("qwen3_235b_a22b", "env.NCCL_P2P_NET_CHUNKSIZE"): _P2P_CHUNK,
    ("deepseek_v3", "env.NCCL_P2P_NET_CHUNKSIZE"): _P2P_CHUNK,
    ("gpt_oss_120b", "env.NCCL_P2P_NET_CHUNKSIZE"): _P2P_CHUNK,
}


def perf_recipe(name: str):
    """NVIDIA's perf recipe function named in the registry's `source`."""
    module, _, fn = registry.get(name).source.rpartition(".")
    return getattr(importlib.import_module(module), fn)


def fields(cfg, target: Target, env: dict) -> dict:
    res = resolve(cfg, target)
    out = {f"model.{k}": getattr(cfg.model, k, None) for k in MODEL}
    # The captured modules under either name (NVIDIA's perf recipes still write the deprecated cuda_graph_scope;
    # ours the current cuda_graph_modules); none without graphs.
    m = cfg.model
    modules = m.cuda_graph_modules if m.cuda_graph_scope is None else m.cuda_graph_scope
    modules = [] if m.cuda_graph_impl == "none" or modules in (None, "full") else modules
    out["model.cuda_graph_modules"] = [modules] if isinstance(modules, str) else [str(x) for x in modules]
    if cfg.model.moe_token_dispatcher_type != "flex":  # Megatron Core reads the backend only with the flex dispatcher
        out["model.moe_flex_dispatcher_backend"] = out["model.moe_hybridep_num_sms"] = None
    out |= {f"resolved.{k}": getattr(res.model, k, None) for k in RESOLVED}
    out |= {f"resolved.ddp.{k}": getattr(res.ddp, k) for k in ("overlap_grad_reduce", "overlap_param_gather")}
    out |= {f"precision.{k}": getattr(cfg.mixed_precision, k) for k in PRECISION}
    out |= {
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.global_batch_size": cfg.train.global_batch_size,
    }
    out |= {"dataset.seq_length": cfg.dataset.seq_length, "model.vocab_size": cfg.model.vocab_size}
    out |= {f"env.{k}": str(v) for k, v in env.items()}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def differences(name: str) -> dict:
    plan = make_plan(name, caller_env={})
    theirs = perf_recipe(name)()
    ours = fields(plan.cfg, plan.target, plan.ledger.values())
    nvidia = fields(theirs, plan.target, theirs.env_vars)
    return {k: (ours.get(k), nvidia.get(k)) for k in sorted(set(ours) | set(nvidia)) if ours.get(k) != nvidia.get(k)}


def deliberate(name: str) -> dict:
    model = name.split("_pretrain_")[0]
    return {f: why for (who, f), why in DELIBERATE.items() if who in ("*", model)}


@pytest.mark.parametrize("name", MOE)
def test_recipe_matches_nvidias_perf_recipe_field_by_field(name):
    diff = differences(name)
    listed = deliberate(name)
    unexplained = {k: v for k, v in diff.items() if k not in listed}
    assert not unexplained, f"{name} differs from {registry.get(name).source} (ours, NVIDIA's): {unexplained}"
    stale = sorted(set(listed) - set(diff))
    assert not stale, f"DELIBERATE lists differences {name} no longer has: {stale}"


def test_a_difference_nobody_listed_fails():
    """The comparison can fail: a field changed on our side shows up as a difference."""
    name = "qwen3_235b_a22b_pretrain_256gpu_h100_bf16"
    plan = make_plan(name, sets="train.global_batch_size=4096", caller_env={})
    theirs = perf_recipe(name)()
    ours, nvidia = fields(plan.cfg, plan.target, {}), fields(theirs, plan.target, {})
    assert (ours["train.global_batch_size"], nvidia["train.global_batch_size"]) == (4096, 8192)


HF = {  # recipe → (hub repo, snapshot): what Bridge's recipe function reads through AutoBridge
    "qwen3_30b_a3b_pretrain_16gpu_h100_bf16": ("Qwen--Qwen3-30B-A3B", "ad44e777bcd18fa416d9da3bd8f70d33ebb85d39"),
    "qwen3_235b_a22b_pretrain_256gpu_h100_bf16": ("Qwen--Qwen3-235B-A22B", "config-only"),
    "deepseek_v3_pretrain_1024gpu_h100_bf16": ("deepseek-ai--DeepSeek-V3", "config-only"),
    "gpt_oss_120b_pretrain_64gpu_h100_bf16": ("openai--gpt-oss-120b", "config-only"),
}


@pytest.mark.parametrize("name", sorted(HF))
def test_shipped_hf_configs_reach_the_megatron_provider(name):
    repo, snap = HF[name]
    hf = json.loads((paths.HF_CACHE / f"models--{repo}" / "snapshots" / snap / "config.json").read_text())
    m = registry.get(name).build().model
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
    assert (m.hidden_size, m.num_layers, m.num_attention_heads) == (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
    )
    assert (m.num_moe_experts, m.moe_router_topk, m.vocab_size) == (
        experts,
        hf["num_experts_per_tok"],
        hf["vocab_size"],
    )
    assert m.moe_ffn_hidden_size == hf.get("moe_intermediate_size", hf["intermediate_size"])
    if "n_shared_experts" in hf:  # DeepSeek-V3: one shared expert, MLA, three dense layers first, one MTP layer
        assert m.moe_shared_expert_intermediate_size == hf["n_shared_experts"] * hf["moe_intermediate_size"]
        assert (m.q_lora_rank, m.kv_lora_rank, m.mtp_num_layers) == (hf["q_lora_rank"], hf["kv_lora_rank"], 1)
        assert m.moe_layer_freq[: hf["first_k_dense_replace"] + 1] == [0, 0, 0, 1]


@pytest.mark.parametrize("name", MOE[:2] + ["llama3_8b_pretrain_8gpu_h100_bf16"])
def test_recipes_set_cuda_graphs_through_the_current_field(name):
    """Megatron Core 0.19 deprecates cuda_graph_scope (migrated to cuda_graph_modules in __post_init__): the recipes
    write cuda_graph_modules and leave the old name unset, whatever their Bridge base wrote."""
    m = make_plan(name, caller_env={}).cfg.model
    assert m.cuda_graph_scope is None
    expected = ["moe_router", "moe_preprocess"] if name == MOE[0] else []  # Bridge's 16-GPU BF16 Qwen3 recipe graphs
    assert [str(getattr(x, "name", x)) for x in m.cuda_graph_modules] == expected
