"""Predicted step time, tokens/s/GPU, TFLOP/s/GPU and MFU of a plan on H100 SXM (or H200), with a breakdown.

The model (docs/throughput.md has the derivation, the sources and the validation against NVIDIA's published runs):

- model FLOPs per step: Bridge's own `num_floating_point_operations` (megatron/bridge/training/utils/flop_utils.py,
  the number behind `log_throughput`), never restated here. It is evaluated three times to split it: at twice the
  sequence length (what grows with s² is core attention) and with a larger vocabulary (what grows with it is the
  output layer). Transformer Engine runs the linear layers in FP8 on an FP8 recipe; core attention (flash/cuDNN)
  and the output layer (megatron-core's ColumnParallelLinear, not a TE module) stay BF16.
- compute: those FLOPs (plus the forward re-run of recomputed layers) at GEMM_EFFICIENCY × the dense peak of
  their dtype, spread over every GPU, plus LAYER_OVERHEAD_S per layer per microbatch: the non-GEMM time (norms,
  activations, RoPE, FP8 casts, kernel launches) fitted as a constant, so it weighs most on small per-GPU slices
  of a layer (CP, TP, MBS 1), as the published runs show.
- TP: per layer and microbatch 4 all-gathers + 4 reduce-scatters of the [s·b/CP, h] activation over NVLink
  (FP8 all-gathers carry 1 B/element); hidden by userbuffers except the last of its TP pipelined chunks when the
  plan's overlap table says tp_comm_overlap "on", all exposed otherwise.
- CP: TE's p2p ring sends K,V (CP−1) times forward, K,V and dK,dV backward; it overlaps only core attention, so
  the excess over the attention compute is exposed.
- EP: 4 all-to-alls per MoE layer and microbatch (dispatch + combine, forward and backward) of top-k copies of
  each token, from the config's num_moe_experts / moe_router_topk / expert_model_parallel_size; hidden behind the
  layer's compute only when the overlap table says ep_a2a_overlap "on".
- PP: the interleaved schedule's bubble (PP−1)/(VPP·m), m = GBS/(DP·MBS), of the per-microbatch time; p2p sends
  of the [s·b/(CP·TP), h] activation, exposed in the fill and drain with overlap_p2p_comm on, all of them off.
- DP: grad reduce-scatter and param all-gather of each GPU's parameters over its DP×CP group (inter-node network
  when the group leaves a node); with overlap on, the part that cannot hide — one bucket each, or what does not
  fit under the last microbatch's backward (RS) / first microbatch's forward (AG) — else all of it.
- optimizer: Adam's memory traffic over the GPU's optimizer shard at HBM bandwidth.

Hardware numbers are public specs (HARDWARE, cited); the two efficiency constants are calibrated on two named
published runs (CALIBRATED_ON) and every other published run is held out (tests/unit_tests/sizing).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from overlapkit.sizing.hardware import HARDWARE, Hardware  # the GPUs' specs, cited there (GPU=)
from overlapkit.sizing.memory import Workload, first_stage_layers
from overlapkit.topology import GPUS_PER_NODE

# The two calibrated constants (docs/throughput.md: how; the test refits them and fails when they drift).
# Calibrated on the newest published run of the smallest and of the largest model (the two ends of the work per GPU
# per layer, which is what separates the two constants); plan/published.py:fit solves them, a test re-solves them.
GEMM_EFFICIENCY = 0.5146  # achieved fraction of the dense Tensor Core peak, BF16 and FP8 alike
LAYER_OVERHEAD_S = 1.630e-3  # non-GEMM time per transformer layer per microbatch (fwd + bwd) on each GPU
CALIBRATED_ON = ("Llama3 8B / Megatron-Bridge 25.11", "Llama3.1 405B / Megatron-Bridge 26.06")
# Adam step per parameter of the local shard (fused multi-tensor Adam): fp32 master, exp_avg, exp_avg_sq read and
# written (24 B), the gradient read (2 B) and the BF16 parameter written back (2 B).
ADAM_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Flops:
    """Model FLOPs of one sequence (forward + backward) as Bridge counts them, split by the dtype they run in."""

    total: float
    attention: float  # core attention (grows with s²)
    logits: float  # output layer

    @property
    def linear(self) -> float:
        return self.total - self.attention - self.logits


def _bridge_flops(model) -> float:
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    return float(num_floating_point_operations(_Cfg(model), 1))


@dataclass
class _Cfg:
    """What num_floating_point_operations reads of a ConfigContainer: the model provider (and peft: none)."""

    model: object
    peft: object = None


def flops_of_model(model) -> Flops:
    """Split Bridge's count for a model provider: at 2·seq (per token, only core attention grows) and with the
    vocabulary grown by one padding multiple (only the output layer grows, linearly in the padded size)."""
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    m = copy.copy(model)
    if m.kv_channels is None:  # megatron-core's default, set at finalize(), which a plan never runs
        m.kv_channels = m.hidden_size // m.num_attention_heads
    total = _bridge_flops(m)
    long = copy.copy(m)
    long.seq_length = 2 * m.seq_length
    attention = m.seq_length * (_bridge_flops(long) / (2 * m.seq_length) - total / m.seq_length)
    step = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
    wide = copy.copy(m)
    wide.vocab_size = m.vocab_size + step
    padded = calculate_padded_vocab_size(
        m.vocab_size, m.make_vocab_size_divisible_by, m.tensor_model_parallel_size, logging_enabled=False
    )
    logits = (_bridge_flops(wide) - total) / step * padded
    return Flops(total, attention, logits)


def flops_of_config(cfg) -> Flops:
    """For a Bridge ConfigContainer (GPT3's provider leaves the vocabulary to the tokenizer, as at runtime)."""
    m = copy.copy(cfg.model)
    if not m.vocab_size:
        m.vocab_size = cfg.tokenizer.vocab_size
    return flops_of_model(m)


def flops_of_shape(shape, tp: int = 1) -> Flops:
    """For a ModelShape (the layout search): a Bridge GPTModelProvider of that shape, with its experts (the last
    `moe_layers` layers MoE, as DeepSeek-V3's leading dense layers) and multi-latent attention where it has them."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    m = GPTModelProvider(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups,
        ffn_hidden_size=shape.ffn,
        seq_length=shape.seq,
        vocab_size=shape.vocab,
        kv_channels=shape.head_dim,
        gated_linear_unit=shape.gated,
        tensor_model_parallel_size=tp,
        share_embeddings_and_output_weights=shape.tied,
    )
    if shape.experts:
        m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = shape.experts, shape.topk, shape.moe_ffn
        m.moe_shared_expert_intermediate_size = shape.shared_ffn or None
        m.moe_layer_freq = [0] * (shape.layers - shape.moe_layers) + [1] * shape.moe_layers
        m.mtp_num_layers = shape.mtp_layers or None
    if shape.kv_lora:  # the fields Bridge's count reads for MLA (MLATransformerConfig's names)
        m.multi_latent_attention = True
        m.q_lora_rank, m.kv_lora_rank = shape.q_lora or None, shape.kv_lora
        m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = shape.qk_head, shape.qk_rope, shape.v_head
    return flops_of_model(m)


@dataclass(frozen=True)
class Overlaps:
    """What the plan's overlap table says is on (state "on"), per overlapped communication."""

    tp: bool = True
    p2p: bool = True
    grad_reduce: bool = True
    param_gather: bool = True
    ep: bool = False

    @classmethod
    def of_rows(cls, states: dict[str, str], ep_default: bool = False) -> Overlaps:
        on = {k: v == "on" for k, v in states.items()}
        ep = on.get("ep_a2a_overlap", ep_default)  # plan/moe.py's row
        return cls(
            on.get("tp_comm_overlap", False),
            on.get("overlap_p2p_comm", False),
            on.get("overlap_grad_reduce", False),
            on.get("overlap_param_gather", False),
            ep,
        )


@dataclass(frozen=True)
class Moe:
    experts: int = 0  # num_moe_experts (0: dense)
    topk: int = 1
    ep: int = 1
    layers: int = 0  # MoE layers (all, unless moe_layer_freq says otherwise)

    @classmethod
    def of_model(cls, m) -> Moe:
        experts = getattr(m, "num_moe_experts", None) or 0
        if not experts:
            return cls()
        freq = getattr(m, "moe_layer_freq", 1)
        layers = sum(freq) if isinstance(freq, list) else math.ceil(m.num_layers / (freq or 1))
        return cls(experts, m.moe_router_topk or 1, m.expert_model_parallel_size or 1, layers)


@dataclass
class Prediction:
    step_s: float
    tokens_per_gpu_s: float
    tflops_per_gpu: float
    mfu: float  # model TFLOP/s/GPU ÷ the dense BF16 peak (NVIDIA's convention in its performance summaries)
    gpu: str
    terms: list = field(default_factory=list)  # (name, seconds, how)

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "step_time_s": round(self.step_s, 4),
            "tokens_per_s_per_gpu": round(self.tokens_per_gpu_s),
            "tflops_per_gpu": round(self.tflops_per_gpu, 1),
            "mfu": round(self.mfu, 4),
            "breakdown": [
                {"term": n, "seconds": round(s, 4), "share": round(s / self.step_s, 4), "how": h}
                for n, s, h in self.terms
            ],
            "calibrated_on": list(CALIBRATED_ON),
        }

    def summary(self) -> str:
        return (
            f"predicted on {HARDWARE[self.gpu].name}: {self.step_s:.2f} s/step · {self.tokens_per_gpu_s:,.0f} "
            f"tokens/s/GPU · {self.tflops_per_gpu:.0f} TFLOP/s/GPU · MFU {self.mfu:.1%} (docs/throughput.md)"
        )

    def share(self, name: str) -> float:
        return sum(s for n, s, _ in self.terms if n == name) / self.step_s


def _crosses_node(span: int) -> bool:
    """A group whose ranks span more than one node's GPUs talks over the network (Megatron orders tp-cp-ep-dp-pp)."""
    return span > GPUS_PER_NODE


@dataclass(frozen=True)
class _Ctx:
    w: Workload
    hw: Hardware
    flops: Flops
    moe: Moe
    eff: float = GEMM_EFFICIENCY
    overhead_s: float = LAYER_OVERHEAD_S

    @property
    def rate(self) -> dict:
        """Achieved FLOP/s per dtype."""
        return {k: v * 1e12 * self.eff for k, v in self.hw.peak_tflops.items()}

    @property
    def gpus(self) -> int:
        return self.w.tp * self.w.pp * self.w.cp * self.w.dp

    @property
    def m(self) -> int:
        return self.w.microbatches

    @property
    def layer_passes(self) -> float:
        """Transformer layers times microbatches each GPU runs per step (its pipeline stage's share)."""
        return self.w.layers / self.w.pp * self.m

    def link(self, span: int) -> float:
        return (self.hw.network_gbs if _crosses_node(span) else self.hw.nvlink_gbs) * 1e9


def _recompute_fraction(w: Workload) -> float:
    """Share of the layers whose forward is run twice (full recompute); selective recomputes core attention only."""
    if w.recompute != "full":
        return 0.0
    per_chunk = first_stage_layers(w)[0]
    if w.recompute_method == "uniform":
        return 1.0
    return min(w.recompute_num_layers or 1, per_chunk) / per_chunk


def compute_terms(c: _Ctx) -> list:
    w, hw, f = c.w, c.hw, c.flops
    peak = c.rate
    rec = _recompute_fraction(w)
    attn_rec = 1 / 3 if w.recompute == "selective" else rec / 3  # a forward is a third of forward + backward
    per_seq = (
        f.linear * (1 + rec / 3) / peak[w.dtype] + f.attention * (1 + attn_rec) / peak["bf16"] + f.logits / peak["bf16"]
    )
    t = per_seq * w.gbs / c.gpus
    how = (
        f"{f.total * w.gbs / 1e15:.2f} PFLOP/step (Bridge's count) / {c.gpus} GPUs at {c.eff:.0%} of "
        f"{hw.peak_tflops[w.dtype]:.0f} TFLOP/s {w.dtype}"
    )
    if w.dtype == "fp8":
        how += " (attention and output layer at bf16's)"
    if rec:
        how += f"; +{rec:.0%} of layers' forward recomputed"
    overhead = c.overhead_s * c.layer_passes
    return [
        ("compute", t, how),
        ("per-layer non-GEMM", overhead, f"{c.layer_passes:.0f} layer×microbatch passes × {c.overhead_s * 1e3:.2f} ms"),
    ]


def tp_term(c: _Ctx, on: bool):
    w = c.w
    if w.tp == 1:
        return None
    act = w.seq * w.mbs / w.cp * w.hidden
    gather = 1 if w.dtype == "fp8" else 2  # FP8 all-gathers move FP8 inputs; reduce-scatters stay BF16
    per_layer = act * (4 * gather + 4 * 2) * (w.tp - 1) / w.tp / c.link(w.tp)
    t = per_layer * c.layer_passes
    exposed = t / w.tp if on else t
    how = f"8 collectives/layer/microbatch over NVLink, {t:.2f} s total; " + (
        f"overlap on: 1/{w.tp} exposed" if on else "overlap OFF: all exposed"
    )
    return ("TP all-gather/reduce-scatter", exposed, how)


def cp_term(c: _Ctx):
    w = c.w
    if w.cp == 1:
        return None
    kv = w.head_dim * w.query_groups
    chunk = w.seq * w.mbs / w.cp * 2 * kv * 2 / w.tp  # K and V of one CP rank's tokens, BF16, per TP rank
    comm = (w.cp - 1) * 3 * chunk / c.link(w.tp * w.cp)  # forward K,V; backward K,V and dK,dV
    attn = c.flops.attention * w.mbs / (w.tp * w.cp * w.layers) / c.rate["bf16"]
    exposed = max(0.0, comm - attn) * c.layer_passes
    return (
        "CP ring exchange",
        exposed,
        f"K/V ring over {w.cp} ranks, {comm * 1e3:.2f} ms/layer vs {attn * 1e3:.2f} ms attention to hide it",
    )


def ep_term(c: _Ctx, on: bool, layer_s: float):
    w, moe = c.w, c.moe
    if not moe.experts or moe.ep == 1:
        return None
    tokens = w.seq * w.mbs / (w.cp * w.tp)
    per_layer = 4 * tokens * moe.topk * w.hidden * 2 * (moe.ep - 1) / moe.ep / c.link(w.tp * w.cp * moe.ep)
    passes = moe.layers / w.pp * c.m
    exposed = (max(0.0, per_layer - layer_s) if on else per_layer) * passes
    how = f"{moe.experts} experts top-{moe.topk} over EP{moe.ep}: 4 all-to-alls/MoE layer/microbatch; " + (
        "overlap on: the excess over the layer's compute" if on else "overlap OFF: all exposed"
    )
    return ("EP all-to-all", exposed, how)


def pipeline_terms(c: _Ctx, on: bool, per_mb_s: float) -> list:
    w = c.w
    if w.pp == 1:
        return []
    vpp = w.vpp or 1
    bubble = (w.pp - 1) / (vpp * c.m) * per_mb_s * c.m
    send = w.seq * w.mbs / (w.cp * w.tp) * w.hidden * 2 / c.link(c.gpus)  # one activation (or its grad)
    sends = 2 * vpp * c.m  # forward and backward, at every chunk boundary
    filled = 2 * (w.pp - 1)  # the fill and the drain, where no compute is there to hide a send
    p2p = send * (filled if on else sends + filled)
    return [
        ("pipeline bubble", bubble, f"(PP−1)/(VPP·m) = {w.pp - 1}/({vpp}·{c.m}) = {(w.pp - 1) / (vpp * c.m):.1%}"),
        (
            "PP p2p",
            p2p,
            f"{send * 1e3:.2f} ms/send; "
            + ("overlap on: fill and drain only" if on else f"overlap OFF: all {sends + filled} sends"),
        ),
    ]


def dp_terms(c: _Ctx, ov: Overlaps, per_mb_s: float, bucket: int | None) -> list:
    w = c.w
    n = w.dp * w.cp  # the distributed optimizer shards over DP×CP
    if n == 1:
        return []
    params = w.shape.total_params / (w.tp * w.pp)
    bw = c.link(w.tp * w.cp * w.dp)
    chunk = w.shape.chunk_params(w.tp, w.pp, w.vpp)
    one = min(bucket or chunk, chunk) * (n - 1) / n / bw
    out = []
    for name, nbytes, on, window in (
        ("DP grad reduce-scatter", 4 if w.grad_fp32 else 2, ov.grad_reduce, 2 / 3 * per_mb_s),
        ("DP param all-gather", 1 if w.fp8_param_gather and w.dtype == "fp8" else 2, ov.param_gather, per_mb_s / 3),
    ):
        full = params * nbytes * (n - 1) / n / bw
        exposed = max(one * nbytes, full - window) if on else full
        net = "network" if _crosses_node(w.tp * w.cp * w.dp) else "NVLink"
        how = f"{params * nbytes / 1e9:.2f} GB over {net} in DP×CP={n}, {full:.2f} s; " + (
            "overlap on: the tail that cannot hide" if on else "overlap OFF: all exposed"
        )
        out.append((name, min(exposed, full), how))
    return out


def optimizer_term(c: _Ctx):
    w = c.w
    shard = w.shape.total_params / (w.tp * w.pp) / ((w.dp * w.cp) if w.distributed_optimizer else 1)
    t = shard * ADAM_BYTES_PER_PARAM / (c.hw.hbm_tbs * 1e12)
    return ("optimizer step", t, f"Adam over {shard / 1e6:.0f}M params × {ADAM_BYTES_PER_PARAM} B at HBM bandwidth")


def predict(
    w: Workload,
    flops: Flops,
    overlaps: Overlaps,
    *,
    gpu: str = "h100",
    moe: Moe | None = None,
    bucket: int | None = None,
    constants: tuple[float, float] | None = None,
) -> Prediction:
    """Step time of workload `w` (its layout, dtype, recompute) with `overlaps` as the plan resolved them.
    `constants`: (GEMM efficiency, per-layer overhead in s) instead of the calibrated ones (for the calibration)."""
    c = _Ctx(w, HARDWARE[gpu], flops, moe or Moe(), *(constants or (GEMM_EFFICIENCY, LAYER_OVERHEAD_S)))
    terms = compute_terms(c)
    layer_s = sum(t for _, t, _ in terms) / c.layer_passes
    terms += [t for t in (tp_term(c, overlaps.tp), cp_term(c), ep_term(c, overlaps.ep, layer_s)) if t]
    per_mb = sum(t for _, t, _ in terms) / c.m
    terms += pipeline_terms(c, overlaps.p2p, per_mb)
    terms += dp_terms(c, overlaps, per_mb, bucket)
    terms.append(optimizer_term(c))
    step = sum(t for _, t, _ in terms)
    tflops = flops.total * w.gbs / c.gpus / step / 1e12
    return Prediction(step, w.gbs * w.seq / c.gpus / step, tflops, tflops / c.hw.peak_tflops["bf16"], gpu, terms)
