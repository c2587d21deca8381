"""The FLOPs the throughput model prices are Bridge's own count, split into core attention, the output layer and
the routed experts by re-evaluating that count (no formula restated)."""

from __future__ import annotations

import copy

import pytest

from overlapkit.bridge import flops
from overlapkit.bridge.registry import get


def test_flops_are_bridges_own_count():
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    cfg = get("llama3_8b_pretrain_8gpu_h100_bf16").build()
    f = flops.flops_of_config(cfg)
    assert f.total / 8192 / 1e9 == pytest.approx(51.47, abs=0.01)  # the reference's check: 51.5 GFLOP/token
    c = copy.copy(cfg)
    c.model = copy.copy(cfg.model)
    c.model.kv_channels = 128
    assert f.total == num_floating_point_operations(c, 1)
    # The split: core attention 6·L·q·s per token (causal: half of QKᵀ's and AV's 4·s·q forward FLOPs, ×3 for the
    # backward; the reference's 51.5 GFLOP/token check adds up with this, not with its printed q·s/2), and the
    # output layer 6·h·V_pad per token.
    assert f.attention == pytest.approx(6 * 32 * 4096 * 8192 * 8192, rel=1e-9)
    assert f.logits == pytest.approx(6 * 4096 * 128256 * 8192, rel=1e-9)


def test_the_routed_experts_split_is_bridges_count_at_top_k(planned):
    """Qwen3 30B-A3B: 48 MoE layers of 128 experts, top-8, expert FFN 768, gated: Bridge counts 6·3·h·ffn·k per
    token and layer for the routed experts (forward and backward), which the split at top-k + 1 recovers."""
    cfg = planned("qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs").cfg
    f = flops.flops_of_config(cfg)
    m = cfg.model
    per_token = 6 * 3 * m.hidden_size * m.moe_ffn_hidden_size * m.moe_router_topk * m.num_layers
    assert f.experts == pytest.approx(per_token * m.seq_length, rel=1e-9)
    assert 0 < f.experts < f.linear
