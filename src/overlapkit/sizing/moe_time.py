"""The mixture-of-experts part of the predicted step time, following Megatron Core's MoE layer
(megatron/core/transformer/moe/: router.py, token_dispatcher.py, experts.py, fused_a2a.py): the expert GEMMs on the
busiest EP rank, the router and permute passes, the dispatchers' all-to-all bytes. docs/throughput.md derives each
term (the EP overlap and the expert-DP reduce are priced with the other collectives in sizing/throughput.py). MLA and
MTP (DeepSeek-V3) need nothing here: Bridge's count carries their FLOPs, and it counts the MTP layer as one more MoE
layer on the last pipeline stage (flop_utils.py `num_moe_layers += mtp_num_layers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from overlapkit.spec.topology import expert_group

# Bytes a dispatched token carries per hidden element: BF16 both ways (the dispatchers move the layer's BF16 input;
# Megatron Core's FP8 dispatch is a separate option the recipes leave off).
A2A_BYTES = 2
# TE CUDA graphs of the router and the dispatcher's preprocess (cuda_graph_impl "transformer_engine") replay the
# kernels before the dispatch as one launch: the share of `moe_token_s` they remove with the flex dispatcher (none
# with alltoall, whose preprocess hands the split sizes to the host). Not fitted: Megatron-Bridge's own measurement,
# docs/throughput.md "CUDA graphs".
GRAPHED_SHARE = 0.5
# FP8 current scaling of the routed experts' GEMM inputs, per element of the token copies entering fc1 and fc2 and of
# their gradients: an amax read (2 B), a cast read and FP8 write (3 B), the transposed FP8 copy for the wgrad (1 B).
FP8_CAST_BYTES = 6
# The router's fp32 logits/probabilities pass: written by the gating GEMM, read and written by the fused softmax/top-k,
# and again in the backward (4 B each, 4 passes).
ROUTER_PASSES = 4


@dataclass(frozen=True)
class Moe:
    experts: int = 0  # num_moe_experts (0: dense)
    topk: int = 1
    ep: int = 1
    layers: int = 0  # MoE layers, the MTP layer(s) included as Bridge counts them
    etp: int = 1
    dispatcher: str = "alltoall"  # model.moe_token_dispatcher_type
    backend: str | None = None  # the flex dispatcher's backend (deepep, hybridep)
    capacity: float | None = None  # moe_expert_capacity_factor; None: dropless
    groups: int = 0  # moe_router_num_groups: group-limited routing (DeepSeek-V3: 8 groups, a token in 4 of them)
    group_topk: int = 0  # moe_router_group_topk
    graphed: bool = False  # TE CUDA graphs capture the router and the dispatcher's preprocess (GRAPHED_SHARE)

    @classmethod
    def of_model(cls, m) -> Moe:
        if not (experts := getattr(m, "num_moe_experts", None) or 0):
            return cls()
        freq = getattr(m, "moe_layer_freq", 1)
        pattern = freq if isinstance(freq, list) else [int(i % (freq or 1) == 0) for i in range(m.num_layers)]
        layers = sum(pattern) + (getattr(m, "mtp_num_layers", None) or 0) * pattern[-1]
        return cls(
            experts,
            m.moe_router_topk or 1,
            m.expert_model_parallel_size or 1,
            layers,
            getattr(m, "expert_tensor_parallel_size", None) or 1,
            getattr(m, "moe_token_dispatcher_type", None) or "alltoall",
            getattr(m, "moe_flex_dispatcher_backend", None) if m.moe_token_dispatcher_type == "flex" else None,
            getattr(m, "moe_expert_capacity_factor", None),
            getattr(m, "moe_router_num_groups", None) or 0,
            getattr(m, "moe_router_group_topk", None) or 0,
            graphed_router(m),
        )

    def hit(self, parts: int) -> float:
        """Expected number of `parts` equal, consecutive slices of the experts (nodes, ranks) that a token's top-k
        distinct experts fall in. Group-limited routing draws them from group_topk of the router's groups only
        (megatron/core/transformer/moe/moe_utils.py `group_limited_topk`): a slice aligned with whole groups is one
        of group_topk·parts/groups candidates."""
        experts = self.experts
        if self.groups and self.group_topk and parts % self.groups == 0:
            experts, parts = experts * self.group_topk // self.groups, parts * self.group_topk // self.groups
        if parts <= 1:
            return 1.0
        miss = math.comb(experts - experts // parts, self.topk) / math.comb(experts, self.topk)
        return parts * (1 - miss)

    def busiest_rank(self, tokens: float) -> float:
        """Expected load of the busiest of the EP ranks over the mean, `tokens` per rank routed top-k at random."""
        if self.ep == 1:
            return 1.0
        n = tokens * self.ep * self.topk  # token-expert pairs in the EP group, each on a rank with p = 1/EP
        mean, sd = n / self.ep, math.sqrt(n * (1 / self.ep) * (1 - 1 / self.ep))
        factor = 1 + expected_max(self.ep) * sd / mean
        return min(factor, self.capacity) if self.capacity else factor


def expected_max(n: int) -> float:
    """Expected maximum of `n` independent standard normal draws, by Blom's approximation Φ⁻¹((n − 0.375)/(n + 0.25))
    (0 for one draw; ≈ √(2 ln n) for large n): the busiest EP rank here, the slowest rank of a synchronising
    collective in throughput.py."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def graph_modules(m) -> set[str]:
    """The modules TE/local CUDA graphs capture per layer (cuda_graph_modules, or the deprecated cuda_graph_scope a
    config from an older Bridge still carries), by name; empty without graphs. An empty list captures the whole layer:
    {"layer"}."""
    if getattr(m, "cuda_graph_impl", "none") in ("none", None):
        return set()
    scope = getattr(m, "cuda_graph_scope", None)
    mods = getattr(m, "cuda_graph_modules", None) if scope is None else scope
    mods = [mods] if isinstance(mods, str) else list(mods or [])
    names = {str(getattr(x, "name", x)) for x in mods} - {"full"}
    return names or {"layer"}


def graphed_router(m) -> bool:
    """TE CUDA graphs hold the MoE layer up to the dispatch (router + preprocess, the whole MoE or the whole layer)
    and the flex dispatcher keeps the host out of the preprocess: the case GRAPHED_SHARE prices."""
    mods = graph_modules(m)
    graphed = {"moe_router", "moe_preprocess"} <= mods or bool(mods & {"moe", "layer"})
    return graphed and m.cuda_graph_impl == "transformer_engine" and m.moe_token_dispatcher_type == "flex"


def a2a_bytes(moe: Moe, tokens: float, hidden: int, gpus_per_node: int) -> tuple[float, float]:
    """(network, NVLink) bytes one GPU sends in one all-to-all of `tokens` tokens."""
    per_node, nodes = expert_group(moe.ep, moe.etp, gpus_per_node)
    row = tokens * hidden * A2A_BYTES
    if moe.dispatcher == "flex":  # once per destination node over the network, once per destination GPU inside
        net = row * moe.hit(nodes) * (nodes - 1) / nodes
        nvl = row * moe.hit(moe.ep) * (per_node - 1) / moe.ep * nodes
        return net, nvl
    copies = row * moe.topk  # one per (token, routed expert): destinations uniform over the EP ranks
    return copies * (moe.ep - per_node) / moe.ep, copies * (per_node - 1) / moe.ep


def layer_terms(c, rate: float, recomputed: float) -> list:
    """The MoE layer's own work beyond a dense layer's: the routed experts' GEMMs (Bridge's expert FLOPs at the
    grouped-GEMM rate, on the busiest EP rank), then the router and permute/unpermute (memory-bound passes at HBM
    bandwidth, plus the fitted per-token time: router scores and top-k, the probabilities applied to k copies, the
    dispatcher's per-token metadata). `rate`: the dense GEMM rate of the run's dtype; `recomputed`: the share of the
    layers whose forward runs twice."""
    w, moe = c.w, c.moe
    t = w.tokens_per_rank
    busiest = moe.busiest_rank(t)
    gemm_s = c.flops.experts * (1 + recomputed / 3) * busiest * w.gbs / c.gpus / (rate * c.k.grouped_gemm)
    gemm_how = (
        f"{c.flops.experts * w.gbs / 1e15:.2f} PFLOP/step of routed experts at {c.k.grouped_gemm:.0%} of the dense "
        f"rate (grouped GEMMs); busiest of EP{moe.ep} ranks at {busiest:.3f}× the mean load"
        + (" (dropless)" if moe.capacity is None else f" (capacity factor {moe.capacity})")
    )
    per_layer = t * (8 * moe.topk * w.hidden * 2 + ROUTER_PASSES * moe.experts * 4) / (c.hw.hbm_tbs * 1e12)
    cast = 0.0
    if w.dtype == "fp8":
        gate_up = w.shape.moe_ffn * (2 if w.shape.gated else 1)
        cast = t * moe.topk * (2 * w.hidden + w.shape.moe_ffn + gate_up) * FP8_CAST_BYTES / (c.hw.hbm_tbs * 1e12)
    passes = moe.layers / w.pp * w.microbatches
    host = 1 - GRAPHED_SHARE if moe.graphed else 1.0
    router_how = (
        f"top-{moe.topk} copies permuted/unpermuted (read + write, fwd + bwd) and the router's logits at HBM "
        f"bandwidth, {per_layer * 1e3:.2f} ms, + {t:.0f} tokens × {c.k.moe_token_s * 1e9:.0f} ns per MoE "
        "layer/microbatch"
        + (f" × {host:.0%} (TE CUDA graphs of the router and preprocess)" if moe.graphed else "")
        + (f"; FP8 casts of the experts' inputs {cast * 1e3:.2f} ms" if cast else "")
    )
    return [
        ("MoE expert GEMMs", gemm_s, gemm_how),
        ("MoE router + permute", (per_layer + cast + c.k.moe_token_s * t * host) * passes, router_how),
    ]
