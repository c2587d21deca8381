"""Predicted step time, tokens/s/GPU, TFLOP/s/GPU and MFU of a plan on H100 SXM (or H200), with a breakdown: one
term per part of the step (compute, per-layer non-GEMM, MoE, TP/CP/EP collectives, the pipeline, DP, the slowest
rank, the optimizer), each derived, sourced and validated against NVIDIA's published runs in docs/throughput.md.

Hardware numbers are datasheet figures (sizing/hardware.py); the fitted constants and their rows are
sizing/calibration.py's; what the model does not price, sizing/knobs.py names.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from overlapkit import jsonio
from overlapkit.sizing import calibration, moe_time
from overlapkit.sizing.calibration import Calibration, Constants
from overlapkit.sizing.hardware import Hardware, hardware
from overlapkit.sizing.memory import Workload, first_stage_layers
from overlapkit.sizing.moe_time import Moe
from overlapkit.spec import model
from overlapkit.spec.overlap import Overlap
from overlapkit.spec.topology import DEFAULT_GPU, GPUS_PER_NODE, expert_group

# Adam step per parameter of the local shard (fused multi-tensor Adam): fp32 master, exp_avg, exp_avg_sq read and
# written (24 B), the gradient read (2 B) and the BF16 parameter written back (2 B).
ADAM_BYTES_PER_PARAM = 28
# NCCL's own cost model of a ring collective (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel, Simple protocol):
# a base latency, then one hop per step, (ranks − 1) steps for a reduce-scatter or an all-gather, of which
# (nodes − 1) cross the network: base 8.4 µs, 3.4 µs per NVLink hop, 9.6 µs per network hop, per collective call.
RING_BASE_S, RING_NVLINK_S, RING_NET_S = 8.4e-6, 3.4e-6, 9.6e-6


@dataclass(frozen=True)
class Flops:
    """Model FLOPs of one sequence (forward + backward) as Bridge counts them, split by the dtype they run in."""

    total: float
    attention: float  # core attention (grows with s²)
    logits: float  # output layer
    experts: float = 0.0  # routed experts' MLPs (part of the linear layers)

    @property
    def linear(self) -> float:
        """Every linear layer but the output layer, the routed experts included."""
        return self.total - self.attention - self.logits


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
        """From the overlap table's states by row (ROWS); without an EP row, `ep_default`."""
        on = {f: states.get(row) == "on" for f, row in ROWS.items()}
        if ROWS["ep"] not in states:
            on["ep"] = ep_default
        return cls(**on)


# Each Overlaps field's row in the plan's overlap table (spec/overlap.py's term): what the model reads, and the name
# make plan's worth table shows (sizing/worth.py).
ROWS = {o.term: str(o) for o in Overlap if o.term}


@dataclass
class Prediction:
    step_s: float
    tokens_per_gpu_s: float
    tflops_per_gpu: float
    mfu: float  # model TFLOP/s/GPU ÷ the dense BF16 peak (NVIDIA's convention in its performance summaries)
    gpu: str
    terms: list = field(default_factory=list)  # (name, seconds, how)
    calibration: str = "published"  # which constants: "published", or "<cluster> fitted on N runs on <date>"
    band: calibration.Band | None = None  # leave-one-out spread of comparable runs: measured/predicted step − 1
    world: str = ""  # what of the step grows with the world size (world_line); empty on one GPU

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
            "calibrated_on": sorted({k for rows in calibration.FITTED_ON.values() for k in rows}),
            "calibration": self.calibration,
            "band": self.band.to_dict() if self.band else None,
            "world": self.world,
        }

    def summary(self) -> str:
        """Two lines: the prediction, then its band and the constants it used."""
        band = "no band"
        if b := self.band:
            band = (
                f"band {self.step_s * (1 + b.low):.2f}–{self.step_s * (1 + b.high):.2f} s/step (leave-one-out "
                f"{b.low:+.0%}…{b.high:+.0%} on {b.of})"
            )
        return (
            f"predicted on {hardware(self.gpu).name}: {self.step_s:.2f} s/step · {self.tokens_per_gpu_s:,.0f} "
            f"tokens/s/GPU · {self.tflops_per_gpu:.0f} TFLOP/s/GPU · MFU {self.mfu:.1%} (docs/throughput.md)\n"
            f"{band}; constants: {self.calibration}" + (f"\n{self.world}" if self.world else "")
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
    k: Constants

    def rate(self, dtype: str) -> float:
        """Achieved FLOP/s of a dense GEMM in `dtype` (on this workload's FP8 recipe for "fp8")."""
        if dtype == "bf16":
            return self.hw.peak_tflops["bf16"] * 1e12 * self.k.gemm_bf16
        blockwise = self.k.blockwise if self.w.fp8_recipe == "blockwise" else 1.0
        return self.hw.peak_tflops["fp8"] * 1e12 * self.k.gemm_fp8 * blockwise

    @property
    def gpus(self) -> int:
        return self.w.tp * self.w.pp * self.w.cp * self.w.dp

    @property
    def layer_passes(self) -> float:
        """Transformer layers times microbatches each GPU runs per step (its pipeline stage's share)."""
        return self.w.layers / self.w.pp * self.w.microbatches

    def link(self, span: int) -> float:
        return (self.hw.network_gbs if _crosses_node(span) else self.hw.nvlink_gbs) * 1e9


def compute_terms(c: _Ctx) -> list:
    """The GPU's work: the GEMMs at their dtype's rate (recomputed forwards included), the per-layer non-GEMM time,
    the MoE layer's own work (moe_time.layer_terms) and the output layer's excess on the last pipeline stage."""
    w, hw, f = c.w, c.hw, c.flops
    # The share of the layers whose forward runs twice: full recompute, of every layer ("uniform") or of the first
    # recompute_num_layers of each chunk ("block").
    rec = 0.0
    if w.recompute == "full":
        per_chunk = first_stage_layers(w)[0]
        rec = 1.0 if w.recompute_method == "uniform" else min(w.recompute_num_layers or 1, per_chunk) / per_chunk
    # The share of core attention recomputed: the layers' share, or under selective recompute all of it with
    # megatron-core's default modules (unset or core_attn), none when they name other modules only (the MoE recipes).
    attn_rec = rec
    if w.recompute == "selective":
        attn_rec = 1.0 if not w.recompute_modules or "core_attn" in w.recompute_modules else 0.0
    attn_rec /= 3  # a forward is a third of forward + backward
    bf16, linear = c.rate("bf16"), c.rate(w.dtype)
    dense_linear = f.linear - f.experts
    per_seq = dense_linear * (1 + rec / 3) / linear + f.attention * (1 + attn_rec) / bf16 + f.logits / bf16
    t = per_seq * w.gbs / c.gpus
    eff = linear / (hw.peak_tflops[w.dtype] * 1e12)
    how = (
        f"{(f.total - f.experts) * w.gbs / 1e15:.2f} PFLOP/step (Bridge's count) / {c.gpus} GPUs at {eff:.0%} of "
        f"{hw.peak_tflops[w.dtype]:.0f} TFLOP/s {w.dtype}"
    )
    if w.dtype == "fp8":
        how += f" ({w.fp8_recipe}; attention and output layer at {c.k.gemm_bf16:.0%} of bf16's)"
    if rec:
        how += f"; +{rec:.0%} of layers' forward recomputed"
    tokens = w.tokens_per_rank  # the GPU's share of the layer's elementwise work (SP splits the rest)
    per_pass = c.k.layer_overhead_s + c.k.layer_token_s * tokens
    passes = (
        f"{c.layer_passes:.0f} layer×microbatch passes × ({c.k.layer_overhead_s * 1e3:.2f} ms + "
        f"{tokens:.0f} tokens × {c.k.layer_token_s * 1e9:.0f} ns)"
    )
    out = [("compute", t, how), ("per-layer non-GEMM", per_pass * c.layer_passes, passes)]
    if c.moe.experts:
        out += moe_time.layer_terms(c, linear, rec)
    # The output layer runs on the last stage only and a pipeline goes at its slowest stage: the last stage's excess
    # over the even share `compute` gave it; not on an interleaved schedule, whose published runs do not show it
    # (docs/throughput.md, "CUDA graphs, and where the MoE predictions went wrong").
    if w.pp > 1 and not (w.account_loss or w.first_chunks or w.vpp):
        even = f.logits / bf16 * w.gbs / c.gpus
        share = f"{f.logits / f.total:.1%} of the FLOPs on 1 of {w.pp} stages (no loss slot in the split)"
        out.append(("output layer on the last stage", even * (w.pp - 1), share))
    return out


def collective_terms(c: _Ctx, ov: Overlaps, layer_s: float) -> list:
    """What the collectives inside a layer leave exposed: TP's all-gathers and reduce-scatters (hidden by userbuffers
    but for the last chunk), CP's K/V ring (hidden by core attention) and EP's all-to-all (hidden by the other
    microbatch's layer compute, `layer_s` per layer pass)."""
    w, moe, out = c.w, c.moe, []
    if w.tp > 1:
        act = w.seq * w.mbs / w.cp * w.hidden
        gather = 1 if w.dtype == "fp8" else 2  # FP8 all-gathers move FP8 inputs; reduce-scatters stay BF16
        per_layer = act * (4 * gather + 4 * 2) * (w.tp - 1) / w.tp / c.link(w.tp)
        moe_share = min(1.0, moe.layers / w.layers) if moe.experts else 0.0
        t = per_layer * c.layer_passes * (1 - moe_share / 2)  # an MoE layer: the attention's collectives only
        exposed = f"overlap on: 1/{w.tp} exposed" if ov.tp else "overlap OFF: all exposed"
        how = f"8 collectives/layer/microbatch over NVLink, {t:.2f} s total; {exposed}"
        out.append(("TP all-gather/reduce-scatter", t / w.tp if ov.tp else t, how))
    if w.cp > 1:
        kv = w.head_dim * w.query_groups
        chunk = w.seq * w.mbs / w.cp * 2 * kv * 2 / w.tp  # K and V of one CP rank's tokens, BF16, per TP rank
        comm = (w.cp - 1) * 3 * chunk / c.link(w.tp * w.cp)  # forward K,V; backward K,V and dK,dV
        attn = c.flops.attention * w.mbs / (w.tp * w.cp * w.layers) / c.rate("bf16")
        how = f"K/V ring over {w.cp} ranks, {comm * 1e3:.2f} ms/layer vs {attn * 1e3:.2f} ms attention to hide it"
        out.append(("CP ring exchange", max(0.0, comm - attn) * c.layer_passes, how))
    if moe.experts and moe.ep > 1:
        net, nvl = moe_time.a2a_bytes(moe, w.tokens_per_rank, w.hidden, GPUS_PER_NODE)
        eff = c.k.a2a_efficiency
        per_layer = 4 * max(net / (c.hw.network_gbs * 1e9 * eff), nvl / (c.hw.nvlink_gbs * 1e9 * eff))
        passes = moe.layers / w.pp * w.microbatches
        per_node, nodes = expert_group(moe.ep, moe.etp, GPUS_PER_NODE)
        dispatcher = f"flex/{moe.backend}" if moe.dispatcher == "flex" else moe.dispatcher
        hidden = "the excess over the other microbatch's layer compute"
        exposed = f"overlap on: {hidden}" if ov.ep else "overlap OFF: all exposed"
        how = (
            f"{dispatcher}: {net / 1e6:.1f} MB network + {nvl / 1e6:.1f} MB NVLink per all-to-all, 4 per MoE "
            f"layer/microbatch, EP{moe.ep} on {nodes} node(s) × {per_node} GPUs, {per_layer * passes:.2f} s; {exposed}"
        )
        out.append(("EP all-to-all", (max(0.0, per_layer - layer_s) if ov.ep else per_layer) * passes, how))
    return out


def pipeline_terms(c: _Ctx, on: bool, per_mb_s: float) -> list:
    """The schedule's bubble (of `per_mb_s`, the time of one microbatch) and what overlap leaves of the p2p sends."""
    w, m = c.w, c.w.microbatches
    if w.pp == 1:
        return []
    vpp = w.vpp or 1
    bubble = (w.pp - 1) / (vpp * m) * per_mb_s * m
    send = w.tokens_per_rank * w.hidden * 2 / c.link(c.gpus)  # one activation (or its grad)
    sends = 2 * vpp * m  # forward and backward, at every chunk boundary
    filled = 2 * (w.pp - 1)  # the fill and the drain, where no compute is there to hide a send
    p2p = send * (filled if on else sends + filled)
    exposed = "overlap on: fill and drain only" if on else f"overlap OFF: all {sends + filled} sends"
    return [
        ("pipeline bubble", bubble, f"(PP−1)/(VPP·m) = {w.pp - 1}/({vpp}·{m}) = {(w.pp - 1) / (vpp * m):.1%}"),
        ("PP p2p", p2p, f"{send * 1e3:.2f} ms/send; {exposed}"),
    ]


def ring_latency(ranks: int, span: int) -> float:
    """Seconds of latency of one ring reduce-scatter or all-gather over `ranks` ranks laid over `span` GPUs (NCCL's
    model: RING_*): it grows with the nodes the group spans, whatever the bytes."""
    nodes = -(-span // GPUS_PER_NODE) if _crosses_node(span) else 1
    return RING_BASE_S + (ranks - nodes) * RING_NVLINK_S + (nodes - 1) * RING_NET_S


def dp_terms(c: _Ctx, ov: Overlaps, per_mb_s: float, bucket: int | None) -> list:
    """The grad reduce-scatter and param all-gather of each GPU's parameters over their DP groups (the dense ones
    over DP×CP, an MoE model's routed experts over expert-DP), what overlap leaves exposed; then Adam's step over the
    GPU's optimizer shard of them."""
    w, moe = c.w, c.moe
    # (params per GPU, group size, group span in GPUs, one bucket in params, name) of each DP group.
    # Routed-expert parameters one GPU holds: EP·ETP shard them, PP splits the layers.
    experts = w.shape.expert_params_per_moe_layer * moe.layers / (moe.ep * moe.etp * w.pp) if moe.experts else 0.0
    dense = (w.shape.total_params - w.shape.expert_params_per_moe_layer * w.shape.moe_layers) / (w.tp * w.pp)
    chunk = w.shape.chunk_params(w.tp, w.pp, w.vpp, moe.ep * moe.etp)
    groups = [(dense, w.dp * w.cp, w.tp * w.cp * w.dp, min(bucket or chunk, chunk), "DP×CP")]
    if experts:
        groups.append((experts, w.expert_dp, moe.etp * moe.ep * w.expert_dp, min(bucket or chunk, chunk), "expert-DP"))
    reduced = [g for g in groups if g[1] > 1]
    # What the tail hides under: one microbatch's backward (RS) or forward (AG) of the last (first) chunk; on an
    # interleaved schedule the other VPP − 1 chunks finish their backward (start their forward) one after another,
    # PP chunk-passes apart, in the cooldown (warm-up), so their collectives run under it.
    vpp = w.vpp or 1
    chunks = (1 + (vpp - 1) * w.pp) / vpp
    out = []
    gather_bytes = 1 if w.fp8_param_gather and w.dtype == "fp8" else 2
    for name, nbytes, on, window in (
        ("DP grad reduce-scatter", 4 if w.grad_fp32 else 2, ov.grad_reduce, 2 / 3 * per_mb_s * chunks),
        ("DP param all-gather", gather_bytes, ov.param_gather, per_mb_s / 3 * chunks),
    ):
        full = one = 0.0
        parts = []
        for params, n, span, bucket_params, group in reduced:
            bw, lat = c.link(span), ring_latency(n, span)
            calls = -(-params // bucket_params)  # one collective per bucket, each paying the ring's latency
            full += params * nbytes * (n - 1) / n / bw + calls * lat
            one = max(one, bucket_params * nbytes * (n - 1) / n / bw + lat)
            net = "network" if _crosses_node(span) else "NVLink"
            parts.append(
                f"{params * nbytes / 1e9:.2f} GB over {net} in {group}={n} ({calls:.0f} × {lat * 1e3:.2f} ms ring "
                "latency)"
            )
        if not parts:
            continue
        exposed = max(one, full - window) if on else full
        tail = "overlap on: the tail that cannot hide" if on else "overlap OFF: all exposed"
        how = "; ".join(parts) + f", {full:.2f} s; {tail}"
        out.append((name, min(exposed, full), how))
    shard = sum(params / (n if w.distributed_optimizer else 1) for params, n, *_ in groups)
    adam = shard * ADAM_BYTES_PER_PARAM / (c.hw.hbm_tbs * 1e12)
    out.append(
        ("optimizer step", adam, f"Adam over {shard / 1e6:.0f}M params × {ADAM_BYTES_PER_PARAM} B at HBM bandwidth")
    )
    return out


def straggler_terms(c: _Ctx) -> list:
    """The wait for the slowest rank at the step's synchronising collectives (the DP gradient sync and the optimizer's
    norm): each rank's step varies by `jitter` of a microbatch, independently per microbatch (σ·√m over the step),
    and the step ends when the slowest of the independent ranks (TP and CP ranks move in lockstep) arrives: the
    expected maximum of N normal draws (moe_time.expected_max, ≈ √(2 ln N)), so it grows with the world."""
    ranks = c.gpus // (c.w.tp * c.w.cp)
    if not (z := moe_time.expected_max(ranks)):
        return []
    how = f"{ranks} independent ranks, step spread σ = {c.k.jitter * 1e3:.0f} ms: the slowest arrives {z:.2f}σ late"
    return [("slowest of N ranks", z * c.k.jitter, how)]


# The terms that grow with the world at a fixed per-GPU shape: the wait for the slowest rank (more ranks), the DP
# tail (its ring latency grows with the nodes; at a fixed GBS fewer microbatches hide it), the bubble (fewer
# microbatches per rank).
GROWING = ("slowest of N ranks", "DP grad reduce-scatter", "DP param all-gather", "pipeline bubble")


def world_line(c: _Ctx, terms: list, step_s: float) -> str:
    """One line: the world (GPUs, DP ranks and the nodes they span, microbatches per DP rank) and the terms that grow
    with it, largest first, with their share of the step; empty on one GPU."""
    w = c.w
    if c.gpus == 1:
        return ""
    grown = sorted(((t, n) for n, t, _ in terms if n in GROWING and t >= 5e-4), reverse=True)  # shown in ms
    span = w.tp * w.cp * w.dp
    nodes = -(-span // GPUS_PER_NODE)
    parts = ", ".join(f"{n} {t * 1e3:.0f} ms" for t, n in grown)
    share = sum(t for t, _ in grown) / step_s
    return (
        f"world: {c.gpus} GPUs, DP×CP {w.dp * w.cp} over {nodes} node(s) ({ring_latency(w.dp * w.cp, span) * 1e3:.2f} "
        f"ms ring latency per collective), {w.microbatches} microbatches per DP rank; grows with it: {parts or 'none'} "
        f"= {share:.1%} of the step"
    )


@dataclass(frozen=True)
class Inputs:
    """What `predict` reads of a plan, held so the fit can re-predict it under other constants."""

    w: Workload
    flops: Flops
    overlaps: Overlaps
    moe: Moe = field(default_factory=Moe)
    bucket: int | None = None
    gpu: str = DEFAULT_GPU
    calibration: Calibration = calibration.PUBLISHED  # the cluster's (make calibrate) or the published

    def predict(self, constants: Constants | None = None, overlaps: Overlaps | None = None) -> Prediction:
        """Step time of the workload (its layout, dtype, recompute) with `overlaps` (else the plan's) on its GPU (a
        sizing/hardware.py row): with this input's calibration (its label and band on the prediction), or with
        `constants` (a fit's trial: no label, no band)."""
        w, flops, ov = self.w, self.flops, overlaps or self.overlaps
        c = _Ctx(w, hardware(self.gpu), flops, self.moe, constants or self.calibration.constants)
        terms = compute_terms(c)
        # What hides an overlapped all-to-all: the other microbatch's GEMMs (its elementwise kernels contend for the
        # SMs the communication kernels run on).
        layer_s = sum(t for n, t, _ in terms if n in ("compute", "MoE expert GEMMs")) / c.layer_passes
        terms += collective_terms(c, ov, layer_s)
        per_mb = sum(t for _, t, _ in terms) / w.microbatches
        terms += pipeline_terms(c, ov.p2p, per_mb)
        terms += dp_terms(c, ov, per_mb, self.bucket)
        terms += straggler_terms(c)
        step = sum(t for _, t, _ in terms)
        tflops = flops.total * w.gbs / c.gpus / step / 1e12
        tokens = w.gbs * w.seq / c.gpus / step
        world = world_line(c, terms, step)
        pred = Prediction(step, tokens, tflops, tflops / c.hw.peak_tflops["bf16"], self.gpu, terms, world=world)
        if constants is None:
            pred.calibration = self.calibration.label
            pred.band = self.calibration.band(bool(self.moe.experts), w.dtype)
        return pred


# The plan's model inputs, written beside plan.json (bridge/build.py): what make calibrate re-predicts under trial
# constants, read without Bridge. Its calibration is not recorded: which constants predict is the reader's.
INPUTS = "inputs.json"
INPUTS_ROLE = "the model inputs that make plan writes beside plan.json"
INPUTS_FIX = "plan and run it again (make plan / make submit): the fit re-predicts the inputs its plan recorded"


def inputs_record(inputs: Inputs) -> dict:
    record = dataclasses.asdict(inputs)
    del record["calibration"]
    return record


def read_inputs(run_dir: Path) -> Inputs:
    """The run directory's recorded inputs (the published calibration); a file that is not a record of them: its
    one line (FileProblem). The dataclasses above are its schema, read strictly as JSON (no "8" for 8); a record
    edited past what the model can price (a zero size, an unknown dtype) is refused here, not mid-fit."""
    path = run_dir / INPUTS
    data = jsonio.read_json(path, role=INPUTS_ROLE, fix=INPUTS_FIX, keys=("w", "flops", "overlaps"))
    try:
        inputs = TypeAdapter(Inputs).validate_json(json.dumps(data), strict=True)
        inputs.predict()
    except ValidationError as exc:
        raise jsonio.file_problem(path, model.problem(exc, data, {}), INPUTS_ROLE, INPUTS_FIX) from None
    except (ArithmeticError, LookupError) as exc:  # the model's formulas met a value no plan writes
        raise jsonio.file_problem(
            path, f"gives no step ({type(exc).__name__}: {exc})", INPUTS_ROLE, INPUTS_FIX
        ) from None
    return inputs
