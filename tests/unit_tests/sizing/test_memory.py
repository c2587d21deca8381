"""overlapkit.sizing.memory: every term against bytes worked out by hand, against Megatron-LM's own theoretical
formula, and on the shipped recipes (all run by NVIDIA on H100 80 GB, so all must fit)."""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import pytest

from overlapkit.bridge import registry
from overlapkit.bridge.build import workload_of
from overlapkit.sizing.memory import (
    GB,
    UB_BUFFERS,
    Workload,
    activation_bytes,
    estimate_workload,
    in_flight_chunks,
    layer_activation_bytes,
)
from overlapkit.spec.shape import ModelShape
from overlapkit.spec.topology import Target

_SHAPE_FIELDS = {f.name for f in fields(ModelShape)}


def estimate(cfg, target: Target):
    """A recipe config's estimate as make plan takes it (bridge/build.py sized): its workload on `target`."""
    return estimate_workload(workload_of(cfg, target), target.gpu)


def w_(base: Workload, **changes) -> Workload:
    """`replace` for a Workload whose changes may name its shape's fields too (query_groups, dtype, layers, ...)."""
    shape = {k: changes.pop(k) for k in list(changes) if k in _SHAPE_FIELDS}
    return replace(base, shape=replace(base.shape, **shape), **changes)


# A Llama-style toy small enough to do by hand: h 1024, 8 heads of 128, 2 query groups, gated FFN 4096, 8 layers,
# vocab 32000, seq 2048 on TP2 PP2 VP2 CP1 DP2, MBS 1, GBS 16 (8 microbatches).
TOY = Workload(ModelShape(hidden=1024, layers=8, heads=8, query_groups=2, ffn=4096, vocab=32000, seq=2048),
               tp=2, pp=2, vpp=2, cp=1, dp=2, mbs=1, gbs=16)  # fmt: skip
PER_LAYER = 1024 * (1024 + 2 * 256) + 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024  # QKV + proj + gated MLP + 2 norms
TOKENS_H_PER_TP = 2048 * 1024 // 2  # s·b·h/(t·CP) elements on one rank


def test_parameters_weights_grads_and_optimizer_by_hand():
    assert PER_LAYER == 15_206_400
    # First stage: 8 layers / (PP2·VP2) = 2 per chunk × 2 chunks = 4 layers, plus the input embedding; / TP2.
    params = (4 * PER_LAYER + 32000 * 1024) // 2
    e = estimate_workload(TOY)
    assert e.params_per_gpu == params == 46_796_800
    assert e.weights_gb * GB == params * 2  # BF16
    assert e.grads_gb * GB == params * 2  # BF16 grad buffer (grad_reduce_in_fp32 off, as the overlap stack sets)
    assert e.optimizer_gb * GB == params * 12 / 2  # fp32 master + m + v, distributed over DP2·CP1
    assert estimate_workload(w_(TOY, cp=2)).optimizer_gb * GB == params * 12 / 4  # over the DP×CP group
    assert estimate_workload(w_(TOY, grad_fp32=True)).grads_gb * GB == params * 4
    assert estimate_workload(w_(TOY, distributed_optimizer=False)).optimizer_gb * GB == params * 12
    # FP8 + fp8_param_gather: FP8 layer weights + their FP8 transpose = 2 B; without it BF16 + FP8 copies = 4 B.
    assert estimate_workload(w_(TOY, dtype="fp8")).weights_gb * GB == params * 2
    no_gather = estimate_workload(w_(TOY, dtype="fp8", fp8_param_gather=False))
    assert no_gather.weights_gb * GB == (4 * PER_LAYER * 4 + 32000 * 1024 * 2) / 2  # embedding stays BF16


def test_activation_bytes_per_layer_by_hand():
    # BF16, SP, flash attention, no dropout, per element of s·b·h/t: 2 norm inputs 4 + QKV input 2 + Q 2 +
    # attention output 2 + K,V 4·(256/1024) + fp32 log-sum-exp 4·8/1024 + FC1 input 2 + FC1 out (gated) 4·4 + FC2 in 2·4
    assert layer_activation_bytes(TOY) == TOKENS_H_PER_TP * 37.03125
    # FP8: QKV, FC1, FC2 inputs saved as FP8 (−1, −1, −4) and proj's own FP8 copy of the attention output (+1)
    assert layer_activation_bytes(w_(TOY, dtype="fp8")) == TOKENS_H_PER_TP * 32.03125
    # SP off: norm, QKV and FC1 inputs (8 B) are replicated on every TP rank (Korthikanti et al. 2022, §4.2.2)
    assert layer_activation_bytes(w_(TOY, sequence_parallel=False)) == 2048 * 1024 * (8 + 29.03125 / 2)
    # GPT-style (MHA, GeLU FFN 4h, dropout): Korthikanti's Table 2 34·sbh/t with flash attention (no 5as/h term)
    gpt = w_(TOY, query_groups=8, gated=False, dropout=True)
    assert layer_activation_bytes(gpt) == TOKENS_H_PER_TP * (34 + 4 * 8 / 1024)
    assert layer_activation_bytes(w_(TOY, cp=2)) == layer_activation_bytes(TOY) / 2  # CP splits the tokens


def test_no_te_terms_by_hand():
    # Unfused (local spec) attention: s² scores per head at 9 B (fp32 softmax 4 + BF16 probs 2 + dropout 3), i.e.
    # 9·a·s/h per element of s·b·h/t, in place of flash attention's fp32 log-sum-exp (4·a/h).
    unfused = w_(TOY, attention="unfused")
    assert layer_activation_bytes(unfused) == TOKENS_H_PER_TP * (37.03125 - 4 * 8 / 1024 + 9 * 8 * 2048 / 1024)
    # Native cross entropy: 10 B per logit (BF16 logits, fp32 copy, fp32 softmax) instead of the fused 4 B.
    pp1 = w_(TOY, pp=1, vpp=None)
    native = estimate_workload(w_(pp1, fused_cross_entropy=False))
    assert native.logits_gb * GB == 2048 * (4 * 1024 + 10 * 32000) / 2
    # A measured card replaces the table's capacity; an H200 is 143771 MiB per nvidia-smi.
    assert estimate_workload(TOY, hbm_gb=24.0).budget_gb == 20.0
    assert estimate_workload(TOY, "h200").budget_gb == pytest.approx(143771 / 1024 - 4)
    assert "(H200 " in estimate_workload(TOY, "h200").summary()


def test_in_flight_microbatches_follow_megatrons_schedules():
    # Interleaved, first stage: 2(PP−1) + (VP−1)·PP warm-up + 1 = 5 chunks of 2 layers = 10 = L·(1 + (PP−1)/(PP·VP))
    assert in_flight_chunks(TOY) == 5
    assert activation_bytes(TOY)[0] == 5 * 2 * layer_activation_bytes(TOY)
    assert in_flight_chunks(w_(TOY, gbs=4)) == 4  # only 2 microbatches × 2 chunks exist
    assert in_flight_chunks(w_(TOY, pp=4, vpp=None)) == 4  # plain 1F1B: PP microbatches
    assert in_flight_chunks(w_(TOY, pp=4, vpp=None, gbs=4)) == 2  # ... or fewer when there are fewer
    assert in_flight_chunks(w_(TOY, pp=1, vpp=None)) == 1


def test_recompute_by_hand():
    a, ckpt = layer_activation_bytes(TOY), 2 * TOKENS_H_PER_TP  # a recomputed group keeps its BF16 input only
    block = w_(TOY, recompute="full", recompute_method="block", recompute_num_layers=1)
    assert activation_bytes(block)[0] == 5 * (ckpt + a) + a  # 1 of 2 layers per chunk recomputed, + 1 in recompute
    uniform = w_(TOY, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    assert activation_bytes(uniform)[0] == 5 * ckpt + 2 * a  # one group per chunk, + the group being recomputed
    assert activation_bytes(w_(TOY, recompute="selective"))[0] == activation_bytes(TOY)[0]  # core_attn: no s²


def test_logits_userbuffers_reserve_and_budget_by_hand():
    pp1 = estimate_workload(w_(TOY, pp=1, vpp=None))
    assert pp1.logits_gb * GB == 4 * 2048 * (1024 + 32000) / 2  # Megatron's 4·s·b·h·(1 + V/h)/t, PP=1 only
    assert pp1.params_per_gpu == (8 * PER_LAYER + 2 * 32000 * 1024) // 2  # and the untied output layer
    assert estimate_workload(TOY).logits_gb == 0  # PP>1: on the last stage, which holds fewer microbatches
    assert estimate_workload(TOY).comm_buffers_gb * GB == 10 * 2048 * 1024 * 2  # 10 userbuffers of [s·b/CP, h] BF16
    assert estimate_workload(w_(TOY, dtype="fp8")).comm_buffers_gb * GB == (6 * 1 + 4 * 2) * 2048 * 1024
    assert estimate_workload(w_(TOY, tp_overlap=False)).comm_buffers_gb == 0
    from megatron.bridge.training.comm_overlap import TransformerLayerTPOverlapCfg  # one buffer per overlapped GEMM

    assert set(UB_BUFFERS) == {f.name for f in fields(TransformerLayerTPOverlapCfg)} and len(UB_BUFFERS) == 10
    e = estimate_workload(TOY)
    assert e.reserve_gb == 3.0 and e.budget_gb == pytest.approx(81559 / 1024 - 4) and e.fits
    rows = e.rows()
    assert [r[0] for r in rows][-1] == "total" and len(rows) == 8 and all(note for _, _, note in rows)
    assert rows[-1][1] == pytest.approx(sum(gb for _, gb, _ in rows[:-1]), abs=0.05)


# --- Megatron-LM's megatron/training/theoretical_memory_usage.py on its own assumptions ----------------------------


def megatron_args(w: Workload):
    return SimpleNamespace(
        kv_channels=w.hidden // w.heads, num_attention_heads=w.heads, hidden_size=w.hidden, ffn_hidden_size=w.ffn,
        group_query_attention=w.query_groups != w.heads, num_query_groups=w.query_groups, num_experts=None,
        swiglu=w.gated, moe_shared_expert_intermediate_size=None, num_layers=w.layers, mtp_num_layers=None,
        normalization="RMSNorm", multi_latent_attention=False, padded_vocab_size=w.vocab,
        untie_embeddings_and_output_weights=not w.tied, moe_latent_size=None, expert_tensor_parallel_size=1,
        expert_model_parallel_size=1, pipeline_model_parallel_size=w.pp, virtual_pipeline_model_parallel_size=w.vpp,
        tensor_model_parallel_size=w.tp, world_size=w.tp * w.pp * w.dp, data_parallel_size=w.dp,
        use_distributed_optimizer=w.distributed_optimizer, seq_length=w.seq, micro_batch_size=w.mbs,
    )  # fmt: skip


# GPT3 175B on TP8 PP8 VP6 DP4 with Megatron's assumptions: fp32 grads, GeLU MLP, dropout on, CP1.
GPT3 = Workload(ModelShape(hidden=12288, layers=96, heads=96, query_groups=96, ffn=49152, vocab=51200, seq=2048,
                           gated=False, dropout=True), tp=8, pp=8, vpp=6, dp=4, gbs=512, grad_fp32=True)  # fmt: skip


@pytest.mark.parametrize("w", [GPT3, w_(GPT3, layers=8, pp=1, vpp=None, dp=64)], ids=["PP8xVP6", "PP1"])
def test_matches_megatrons_theoretical_memory_usage(w):
    from megatron.training import theoretical_memory_usage as tmu

    e, args = estimate_workload(w), megatron_args(w)
    # Megatron: (6 + 12/DP) B per parameter of the most loaded shard; it keeps norms un-split by TP (≈1e-4 off).
    static = (e.weights_gb + e.grads_gb + e.optimizer_gb) * GB
    assert static == pytest.approx(tmu.compute_weight_and_optimizer_memory(args), rel=1e-3)
    # Megatron: s·b·h·(18 + 4·ffn/h)·L·(1 + (PP−1)/(PP·VP))/t + tiny embedding terms; ours adds the log-sum-exp.
    act = (e.activations_gb + e.logits_gb) * GB
    assert act == pytest.approx(tmu.compute_activation_memory(args, num_microbatches=w.microbatches), rel=5e-3)


# --- the shipped recipes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", registry.names())
def test_every_shipped_recipe_fits_an_h100(name):
    r = registry.get(name)
    e = estimate(r.build(), Target(nodes=r.nodes))
    # NVIDIA ran each of these on H100 80 GB, and tuned its layout to use most of the card.
    assert e.fits, e.rows()
    assert e.total_gb > 50, e.rows()


def test_70b_on_tp1_pp1_is_flagged_as_not_fitting():
    cfg = registry.get("llama3_70b_pretrain_64gpu_h100_bf16").build()
    m = cfg.model
    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
    m.virtual_pipeline_model_parallel_size = None
    e = estimate(cfg, Target(nodes=8))
    assert not e.fits and e.total_gb > 3 * e.budget_gb and "does NOT fit" in e.summary()
    assert e.params_per_gpu > 70e9  # the whole model on one GPU


def test_8b_fp8_fits_only_with_its_5_layer_recompute():
    # NVIDIA's 8B FP8 recipe (TP1 CP1) recomputes 5 layers; the estimate shows why.
    r = registry.get("llama3_8b_pretrain_8gpu_h100_fp8cs")
    cfg = r.build()
    assert estimate(cfg, Target(nodes=1)).fits
    cfg.model.recompute_granularity = cfg.model.recompute_method = cfg.model.recompute_num_layers = None
    assert not estimate(cfg, Target(nodes=1)).fits


def test_more_nodes_shard_the_optimizer_further():
    cfg = registry.get("llama3_70b_pretrain_64gpu_h100_bf16").build()
    e8, e16 = estimate(cfg, Target(nodes=8)), estimate(cfg, Target(nodes=16))
    assert e16.optimizer_gb == pytest.approx(e8.optimizer_gb / 2) and e16.weights_gb == e8.weights_gb
