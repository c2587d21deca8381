"""The MoE terms on bare numbers: where an EP group's ranks sit, how many nodes and ranks a token's top-k experts
reach (group-limited routing included), what each dispatcher sends over the network and NVLink, and the busiest
rank's load under random (force-balanced) routing."""

from __future__ import annotations

import math

import pytest

from overlapkit.sizing import moe_time
from overlapkit.spec.topology import expert_group

QWEN30 = moe_time.Moe(128, 8, 16, 48, dispatcher="flex", backend="hybridep")
QWEN235 = moe_time.Moe(128, 8, 32, 94)
DSV3 = moe_time.Moe(256, 8, 64, 59, dispatcher="flex", backend="hybridep", groups=8, group_topk=4)


def test_an_ep_group_fills_nodes_etp_ranks_apart():
    assert expert_group(16) == (8, 2) and expert_group(64) == (8, 8) and expert_group(4) == (4, 1)
    assert expert_group(8, etp=2) == (4, 2)


def test_a_token_reaches_the_expected_number_of_nodes():
    # 128 experts on 2 nodes, top-8: a token misses a node with probability C(64,8)/C(128,8)
    miss = math.comb(64, 8) / math.comb(128, 8)
    assert QWEN30.hit(2) == pytest.approx(2 * (1 - miss))
    assert moe_time.Moe(128, 1, 16).hit(16) == pytest.approx(1.0)  # top-1: one rank
    # DeepSeek-V3's 8 groups = 8 nodes, 4 groups per token: at most 4 nodes, fewer than unlimited routing reaches
    unlimited = moe_time.Moe(256, 8, 64).hit(8)
    assert DSV3.hit(8) < 4 < unlimited


def test_flex_sends_a_token_once_per_node_alltoall_once_per_expert():
    tokens, hidden = 4096, 2048
    row = tokens * hidden * moe_time.A2A_BYTES
    net, nvl = moe_time.a2a_bytes(QWEN30, tokens, hidden, 8)
    assert net == pytest.approx(row * QWEN30.hit(2) / 2)  # the other node, when the token has an expert there
    a2a_net, _ = moe_time.a2a_bytes(moe_time.Moe(128, 8, 16, 48), tokens, hidden, 8)
    assert a2a_net == pytest.approx(row * 8 / 2)  # top-8 copies, half of them off the node
    assert a2a_net > 3.9 * net
    inside_net, inside_nvl = moe_time.a2a_bytes(moe_time.Moe(128, 8, 8, 48), tokens, hidden, 8)
    assert inside_net == 0 and inside_nvl == pytest.approx(row * 8 * 7 / 8)


def test_the_busiest_rank_of_random_routing():
    assert moe_time.Moe(128, 8, 1).busiest_rank(4096) == 1.0
    got = QWEN235.busiest_rank(2048)
    mean, sd = 2048 * 8, math.sqrt(2048 * 32 * 8 * (1 / 32) * (31 / 32))
    assert got == pytest.approx(1 + 2.07 * sd / mean, rel=0.01)  # Φ⁻¹((32 − 0.375)/(32.25)) ≈ 2.07
    assert moe_time.Moe(128, 8, 32, capacity=1.0).busiest_rank(2048) == 1.0  # a capacity factor caps it
    assert QWEN235.busiest_rank(256) > got  # fewer tokens: a larger relative spread
