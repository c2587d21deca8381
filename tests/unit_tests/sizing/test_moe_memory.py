"""MoE and MLA sizing (overlapkit.sizing.moe_memory, overlapkit.spec.shape): parameter counts against the model cards,
and each memory term against bytes worked out by hand on a toy MoE small enough to do on paper."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlapkit.bridge import registry
from overlapkit.bridge.build import make_plan
from overlapkit.sizing import moe_memory
from overlapkit.sizing.memory import GB, Workload, estimate_workload, layer_activation_bytes
from overlapkit.spec.shape import ModelShape

# Published counts. Qwen3 cards (huggingface.co/Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B) count the embedding among
# the activated parameters; DeepSeek-V3's README ("36.6B activated, including 0.9B for the output head" of its 37B)
# and OpenAI's gpt-oss model card (116.83B total, 5.13B active) do not.
CARDS = {
    "qwen3_30b_a3b_pretrain_16gpu_h100_bf16": (30.5, 3.3, True),
    "qwen3_235b_a22b_pretrain_256gpu_h100_bf16": (235.0, 22.0, True),
    "deepseek_v3_pretrain_1024gpu_h100_bf16": (671.0, 36.6, False),
    "gpt_oss_120b_pretrain_64gpu_h100_bf16": (116.83, 5.13, False),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_total_and_active_parameters_match_the_model_cards(name):
    total, active, with_embedding = CARDS[name]
    s = ModelShape.of(registry.get(name).build())
    got_active = s.active_params + (s.vocab * s.hidden if with_embedding else 0)
    assert s.total_params / 1e9 == pytest.approx(total, rel=0.005)
    assert got_active / 1e9 == pytest.approx(active, rel=0.03)


def test_plan_prints_total_and_active_parameters():
    p = make_plan("qwen3_235b_a22b_pretrain_256gpu_h100_bf16")
    assert (p.layout["params_b"], p.layout["active_params_b"], p.layout["ep"], p.layout["expert_dp"]) == (
        235.1, 21.6, 32, 1)  # fmt: skip


# A toy MoE: h 1024, 4 layers all MoE, 8 heads of 128 (GQA, 2 groups), 8 experts of FFN 512, top-2, one shared expert
# of FFN 512, vocab 32000, seq 2048; TP1 PP1 EP4 DP8 (expert-DP 2 on 16 GPUs... given directly here), MBS 1.
TOY = Workload(
    ModelShape(hidden=1024, layers=4, heads=8, query_groups=2, ffn=2048, seq=2048, vocab=32000, experts=8, topk=2,
               moe_ffn=512, shared_ffn=512, moe_layers=4),
    tp=1, pp=1, dp=8, ep=4, etp=1, expert_dp=2, mbs=1, gbs=8,
)  # fmt: skip
ATTN = 1024 * (1024 + 2 * 256) + 1024 * 1024 + 1024  # QKV + proj + input norm
EXPERT = 3 * 1024 * 512  # one gated expert
NON_EXPERT_MOE = ATTN + 1024 * 8 + EXPERT + 1024  # + router + shared expert + pre-MLP norm


def test_shape_splits_non_expert_and_expert_parameters_by_hand():
    s = TOY.shape
    assert s.layer_split == (NON_EXPERT_MOE, 8 * EXPERT)
    assert s.total_params == 4 * (NON_EXPERT_MOE + 8 * EXPERT) + 2 * 32000 * 1024 + 1024
    assert s.active_params == s.total_params - 4 * 6 * EXPERT - 32000 * 1024  # 6 of 8 experts idle; no lookup
    assert s.chunk_params(tp=1, pp=1, vpp=None, ep_etp=4) == 4 * (NON_EXPERT_MOE + 2 * EXPERT)


def test_weights_and_optimizer_shard_experts_by_ep_and_expert_dp_by_hand():
    e = estimate_workload(TOY)
    dense = 4 * NON_EXPERT_MOE + 2 * 32000 * 1024  # PP=1: embedding and output layer on the first stage
    experts = 4 * 8 * EXPERT // 4  # 2 of 8 experts per EP rank
    assert e.params_per_gpu == dense + experts
    assert e.weights_gb * GB == (dense + experts) * 2
    assert e.optimizer_gb * GB == pytest.approx(dense * 12 / 8 + experts * 12 / 2)  # DP8; expert-DP2
    unsharded = estimate_workload(replace(TOY, expert_dp=1))
    assert (unsharded.optimizer_gb - e.optimizer_gb) * GB == pytest.approx(experts * 12 / 2)


def test_moe_activation_terms_by_hand():
    t = moe_memory.mlp_terms(TOY, lin=2)
    # top-2: two copies of each token into the experts, each FC1 output 2·512 wide (gated) in BF16 = 4·2·0.5 units.
    assert t["dispatched tokens (top-k copies, experts' FC1 input)"] == 2 * 2
    assert t["FC1 output"] == 4 * (2 * 0.5 + 0.5)  # experts + the shared expert
    assert t["FC2 input"] == 2 * (2 * 0.5 + 0.5)
    assert t["router logits + probs (fp32)"] == 8 * 8 / 1024
    tokens_h = 2048 * 1024
    assert layer_activation_bytes(TOY) == pytest.approx(tokens_h * (4 + 2 + 4 * 1 + 4 * 0.25 + 4 * 8 / 1024 + sum(
        t.values())))  # fmt: skip
    # Recompute of the expert activation drops the experts' FC2 input (the shared expert's stays).
    no_act = moe_memory.mlp_terms(replace(TOY, recompute_modules=("moe_act",)), lin=2)
    assert no_act["FC2 input"] == 2 * 0.5


def test_mla_up_projection_recompute_drops_q_k_v():
    s = ModelShape(hidden=7168, layers=1, heads=128, query_groups=128, ffn=18432, seq=4096, vocab=129280,
                   q_lora=1536, kv_lora=512, qk_head=128, qk_rope=64, v_head=128)  # fmt: skip
    w = Workload(s)
    full, recomputed = (moe_memory.attention_terms(replace(w, recompute_modules=r), 2) for r in ((), ("mla_up_proj",)))
    assert recomputed["K + V (MLA)"] == 0 < full["K + V (MLA)"]
    assert recomputed["Q + attention output"] == 2 * 128 * 128 / 7168  # the attention output stays


@pytest.mark.parametrize("name", sorted(CARDS))
def test_every_moe_recipe_fits_an_h100(name, planned):
    assert planned(name).memory.fits


# --- the model Bridge's provider builds, on the meta device ---------------------------------------------------------


def _no_param_core_attention(orig):
    """MLA's layer specs with a parameter-free core attention: Megatron Core's local DotProductAttention rejects MLA's
    k_channels and TE is absent here; softmax(QKᵀ)V has no parameters either way."""
    import inspect

    import torch

    class CoreAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    def spec(config, vp_stage=None):
        s = orig(config, vp_stage=vp_stage) if "vp_stage" in inspect.signature(orig).parameters else orig(config)
        for layer in s.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = CoreAttention
        return s

    return spec


def _cpu_buildable(m):
    """The recipe's provider, unsharded and without TE: every parameter on one rank, local (torch) modules."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.enums import AttnBackend

    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
    m.expert_model_parallel_size = m.expert_tensor_parallel_size = 1
    m.virtual_pipeline_model_parallel_size = m.pipeline_dtype = m.pipeline_model_parallel_layout = None
    m.sequence_parallel = m.account_for_embedding_in_pipeline_split = m.account_for_loss_in_pipeline_split = False
    m.transformer_impl, m.moe_grouped_gemm, m.fp8 = "local", False, None
    # allgather: the alltoall dispatcher creates a CUDA stream at construction; parameters do not depend on it.
    m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend, m.moe_shared_expert_overlap = "allgather", None, False
    m.gradient_accumulation_fusion = m.apply_rope_fusion = m.masked_softmax_fusion = m.persist_layer_norm = False
    m.bias_activation_fusion = m.moe_router_fusion = m.moe_permute_fusion = m.cross_entropy_loss_fusion = False
    m.cuda_graph_impl, m.cuda_graph_modules, m.cuda_graph_scope, m.use_te_rng_tracker = "none", [], None, False
    m.recompute_granularity = m.recompute_modules = None
    m.mtp_num_layers = None  # Bridge builds the MTP block with TE only (gpt_provider.mtp_block_spec): see MTP test
    if m.multi_latent_attention:
        m.transformer_layer_spec = _no_param_core_attention(m.transformer_layer_spec)
    else:
        m.transformer_layer_spec, m.attention_backend = local_layer_spec, AttnBackend.local
    m.init_model_with_meta_device = m.use_cpu_initialization = True
    m.perform_initialization = False  # the initial values: 30k normal_ draws on meta tensors, no parameter's count
    return m


@pytest.mark.parametrize("name", sorted(CARDS))
def test_parameter_count_equals_the_model_bridge_builds_on_the_meta_device(name, one_rank, monkeypatch):
    """Every expert of every layer is built (on the meta device: no memory; no initial values: 2-12 s each)."""
    import torch
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    # Mocked because they cannot exist on CPU: the YaRN cos/sin cache is a CUDA buffer (no parameters), and a few
    # parameters (GPT-OSS's softmax sinks) ask for torch.cuda.current_device() explicitly.
    monkeypatch.setattr(yarn.YarnRotaryEmbedding, "_set_cos_sin_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    cfg = registry.get(name).build()
    shape = ModelShape.of(cfg)
    m = _cpu_buildable(cfg.model)
    m.finalize()
    m._pg_collection = one_rank
    with torch.device("meta"):
        model = m.provide()
    built = sum(p.numel() for p in model.parameters())
    assert {type(x).__module__.split(".")[0] for x in model.modules()} <= {"megatron", "torch", __name__.split(".")[0]}
    # Biases of the attention's QK norms and the like aside, the estimate's count is the built model's.
    assert built == pytest.approx(shape.total_params, rel=1e-6)
