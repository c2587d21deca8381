"""Per-GPU memory estimate for transformer recipes on H100 80 GB: does the first step OOM? (Mixture-of-experts and
multi-latent-attention terms: sizing/moe_memory.py.)

"GB" here is GiB (2**30 B), the unit of torch.cuda memory stats and of nvidia-smi's MiB/1024. The peak is on the
first pipeline stage: it holds the input embedding and the most in-flight microbatches (as in Megatron-LM's
`megatron/training/theoretical_memory_usage.py`, which this follows). Per component:

- weights: BF16, 2 B/param. FP8 with fp8_param_gather: transformer-layer weights are FP8 (1 B) plus the FP8
  transpose TE caches for the backward GEMMs (Hopper FP8 GEMMs take only the TN layout): 2 B; FP8 without it: BF16
  plus TE's cached FP8 copy and transpose: 4 B. Embedding and output layer stay BF16.
- grads: Megatron DDP's grad buffer holds fp32 when ddp.grad_reduce_in_fp32, else the param dtype (BF16): 4 or 2 B.
- optimizer: Adam keeps fp32 master params + m + v = 12 B/param (ZeRO, Rajbhandari et al. 2020, K=12; Megatron's
  `6 + 12/DP` bytes/param). The distributed optimizer shards it over the DP×CP group (megatron-core builds it on
  `intra_dp_cp_group`); Megatron's formula divides by DP alone. The fp32 copy of the grad shard made at the step
  is not counted: activations are freed by then.
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") Table 2,
  sequence parallel: s·b·h·(34 + 5·a·s/h)/t bytes per layer. Adapted: flash/fused attention (TE's default on H100)
  stores no s² softmax/dropout tensors, only its output and a fp32 log-sum-exp per head and token; Q, K, V sized
  for GQA; a gated MLP stores both FC1 halves; dropout masks only when hidden_dropout > 0 (Llama: 0); FP8 runs save
  the four linear-layer inputs as FP8. Tokens per rank are s·b/CP. For GPT3 with dropout this is Megatron's
  `s·b·h·(18 + 4·ffn/h)/t`. Times the layers the first stage holds at once: 1F1B holds min(PP, microbatches)
  microbatches of its layers; the interleaved schedule holds 2(PP−1) + (VPP−1)·PP + 1 chunk-microbatches
  (megatron/core/pipeline_parallel/schedules.py get_pp_rank_microbatches), which is Megatron's
  `L·(1 + (PP−1)/(PP·VPP))`. Recompute: "full" keeps each recomputed group's input (2·s·b·h/(t·CP)) plus one
  group's activations while it is recomputed; "selective" recomputes core attention (megatron-core's default
  recompute_modules), which flash attention already does not store: no saving is credited.
- logits: PP=1 only (the first stage is also the last): Megatron's 4·s·b·h·(1 + V/h)/t.
- Without TE (the 1-GPU cuts of gpucut.py): megatron-core's local, unfused core attention stores s² scores per
  head — Korthikanti's 5·a·s/h term, with 9 B per score because its torch softmax path keeps an fp32 output — and
  the native cross entropy keeps 10 B per logit (BF16 logits, fp32 copy, fp32 softmax) instead of 4.
- userbuffers (TP overlap on): TE's initialize_ub registers one buffer per overlapped GEMM, the ten fields of
  Bridge's TransformerLayerTPOverlapCfg (qkv/proj/fc1/fc2 fprop and dgrad, qkv/fc1 wgrad), each the full
  [s·b/CP, h] tensor; in FP8 the six all-gather ones are FP8 (1 B), the rest BF16.
- reserve: 3 GB for the CUDA context (~1 GB), NCCL communicators of the TP/PP/DP/CP/DP×CP groups (~1.5 GB) and
  cuBLAS/TE workspaces (~0.5 GB).

Fits when the total is within the GPU's HBM (sizing/hardware.py: H100 80 GB = 81559 MiB per nvidia-smi = 79.6 GB;
H200 140.4 GB) minus a 4 GB margin (5% of an H100) for allocator fragmentation. Validation: on the formula's own
assumptions the weight+optimizer and activation terms equal Megatron-LM's theoretical_memory_usage
(tests/unit_tests/test_memory.py); every shipped recipe, all run by NVIDIA on H100 80 GB, estimates inside the
budget, with Llama3 8B FP8 only thanks to its 5-layer full recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from overlapkit.sizing import moe_memory
from overlapkit.sizing.hardware import HARDWARE
from overlapkit.spec.shape import ModelShape
from overlapkit.spec.topology import DEFAULT_GPU

GB = 2**30
MARGIN_GB = 4.0  # allocator fragmentation: about 5% of the card
RESERVE_GB = 3.0  # CUDA context + NCCL communicators + cuBLAS/TE workspaces (see the module docstring)
UB_BUFFERS = ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad", "qkv_fprop")
UB_BUFFERS += ("proj_dgrad", "fc1_fprop", "fc2_dgrad", "proj_fprop", "fc2_fprop")  # Bridge's TP overlap cfg fields
UB_ALL_GATHER = {"qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad", "qkv_dgrad", "fc1_dgrad"}  # FP8 under FP8


@dataclass(frozen=True)
class Workload:
    """Everything the estimate reads: the model's shape, the layout and the precision/recompute knobs."""

    shape: ModelShape
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    mbs: int = 1
    gbs: int = 1
    sequence_parallel: bool = True
    tp_overlap: bool = True
    fp8_param_gather: bool = True
    grad_fp32: bool = False
    distributed_optimizer: bool = True
    recompute: str | None = None  # model.recompute_granularity
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    mb_group: int | None = None  # microbatch_group_size_per_vp_stage (megatron-core default: PP)
    attention: str = "flash"  # "flash" (TE fused/flash) | "unfused" (megatron-core's local DotProductAttention)
    fused_cross_entropy: bool = True  # False: native vocab-parallel cross entropy (the no-TE 1-GPU cut)
    ep: int = 1  # expert parallelism (MoE): routed experts split by EP·ETP
    etp: int = 1
    expert_dp: int = 1  # expert-data-parallel size: what shards the experts' optimizer states
    recompute_modules: tuple[str, ...] = ()  # selective recompute (credited for MoE/MLA models: moe_memory)
    first_chunks: tuple[int, ...] | None = None  # decoder layers per chunk of the first stage, from an explicit layout
    fp8_recipe: str = "tensorwise"  # mixed_precision.fp8_recipe on an FP8 run (delayed, tensorwise, blockwise, mxfp8)

    def __getattr__(self, name: str):
        """The shape's fields read as the workload's own (w.hidden, w.seq, w.dtype, ...): the formulas stay short."""
        if name == "shape":  # not set yet (copy/unpickle): never recurse
            raise AttributeError(name)
        return getattr(self.shape, name)

    @property
    def microbatches(self) -> int:
        return max(1, self.gbs // (self.dp * self.mbs))

    @property
    def tokens_per_rank(self) -> float:
        """Tokens of a microbatch one GPU's layer works on: its sequence-parallel slice s·b/(CP·TP) (and, ETP 1, the
        tokens it routes in an MoE layer: the MoE layer keeps the TP split)."""
        return self.seq * self.mbs / (self.cp * self.tp)


@dataclass(frozen=True)
class MemoryEstimate:
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    logits_gb: float
    comm_buffers_gb: float
    reserve_gb: float
    hbm_gb: float
    margin_gb: float
    params_per_gpu: int
    notes: dict[str, str] = field(default_factory=dict)
    gpu: str = DEFAULT_GPU
    PARTS = ("weights", "grads", "optimizer", "activations", "logits", "comm_buffers", "reserve")  # each <part>_gb

    @property
    def total_gb(self) -> float:
        return sum(getattr(self, f"{n}_gb") for n in self.PARTS)

    @property
    def budget_gb(self) -> float:
        return self.hbm_gb - self.margin_gb

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.budget_gb

    @property
    def headroom_gb(self) -> float:
        return self.budget_gb - self.total_gb

    def rows(self) -> list[tuple[str, float, str]]:
        """(component, GB, note) per component, then the total; for a table."""
        out = [(n, round(getattr(self, f"{n}_gb"), 2), self.notes.get(n, "")) for n in self.PARTS]
        return out + [("total", round(self.total_gb, 2), f"{self.verdict}: budget {self.budget_gb:.1f} GB")]

    @property
    def over_hbm(self) -> bool:
        """More than the GPU holds at all: not the margin's question (the plan's audit makes it an error)."""
        return self.total_gb > self.hbm_gb

    @property
    def verdict(self) -> str:
        if self.fits:
            return "fits"
        return "does NOT fit" if self.over_hbm else f"fits only inside the {self.margin_gb:.0f} GB margin"

    def summary(self) -> str:
        return (
            f"memory (first pipeline stage, per GPU): {self.total_gb:.1f} GB of {self.budget_gb:.1f} GB budget "
            f"({self.gpu.upper()} {self.hbm_gb:.1f} GB − {self.margin_gb:.0f} GB margin): {self.verdict}"
        )


def first_stage_layers(w: Workload) -> tuple[int, int]:
    """(transformer layers per model chunk, layers on the first stage). Bridge's accounting puts the embedding in
    the first chunk's share; the chunk size is rounded up, an upper bound when the split is uneven."""
    if w.pp == 1:
        return w.layers, w.layers
    if w.first_chunks:  # explicit layout: the largest chunk, and every layer of the first stage
        return max(w.first_chunks), sum(w.first_chunks)
    vpp = w.vpp or 1
    per_chunk = math.ceil(w.pipeline_units / (w.pp * vpp))
    return per_chunk, min(w.layers, per_chunk * vpp - w.account_embedding)


_REPLICATED_WITHOUT_SP = ("norm inputs (2 norms)", "QKV input", "FC1 input", "dropout masks")  # Korthikanti §4.2.2


def layer_activation_bytes(w: Workload) -> float:
    """Bytes one layer stores per microbatch; see the module docstring for the derivation."""
    q, kv, f = w.head_dim * w.heads / w.hidden, w.head_dim * w.query_groups / w.hidden, w.ffn / w.hidden
    lin = 1 if w.dtype == "fp8" else 2  # TE saves FP8 copies of linear inputs under FP8
    # Per layer, in units of (tokens·h) elements.
    if w.kv_lora:
        terms = moe_memory.attention_terms(w, lin)
    else:
        terms = {
            "norm inputs (2 norms)": 4,
            "QKV input": lin,
            "Q + attention output": 4 * q + (q if w.dtype == "fp8" else 0),  # FP8: proj also saves its FP8 input
            "K + V (GQA)": 4 * kv,
            "flash-attn log-sum-exp (fp32)": 4 * w.heads / w.hidden if w.attention == "flash" else 0,
        }
    if w.shape.is_moe or w.kv_lora:
        if "layernorm" in w.recompute_modules:  # the norms' outputs (the linear inputs) are recomputed
            terms["QKV input"] = 0
        terms |= moe_memory.mlp_terms(w, lin) if w.shape.is_moe else {}
    else:
        # Unfused (local spec) core attention stores s² scores per head: the fp32 softmax output (4 B, its
        # backward input), the BF16 probabilities (2 B, the V-bmm input) and dropout output + mask (3 B) —
        # Korthikanti's 5·a·s/h counted with the fp32 softmax that megatron-core's torch path keeps.
        terms["unfused attention scores"] = 9 * w.heads * w.seq / w.cp / w.hidden if w.attention == "unfused" else 0
        terms |= {"FC1 input": lin, "FC1 output": (4 if w.gated else 2) * f, "FC2 input": lin * f}
    terms["dropout masks"] = 2 if w.dropout else 0
    tokens = w.seq * w.mbs / w.cp
    if w.sequence_parallel or w.tp == 1:
        return tokens * w.hidden * sum(terms.values()) / w.tp
    rep = sum(v for k, v in terms.items() if k in _REPLICATED_WITHOUT_SP)
    return tokens * w.hidden * (rep + (sum(terms.values()) - rep) / w.tp)


def in_flight_chunks(w: Workload) -> int:
    """Model-chunk forward passes whose activations the first stage holds at the peak."""
    if w.pp == 1:
        return 1
    if not w.vpp or w.vpp == 1:
        return min(w.pp, w.microbatches)
    warmup = 2 * (w.pp - 1) + (w.vpp - 1) * (w.mb_group or w.pp)
    return min(warmup + 1, w.microbatches * w.vpp)


def activation_bytes(w: Workload) -> tuple[float, str]:
    per_layer, chunk_layers = layer_activation_bytes(w), first_stage_layers(w)[0]
    ckpt = 2 * w.seq * w.mbs / w.cp * w.hidden / w.tp  # a recomputed group's BF16 input, sequence-sharded
    n = w.recompute_num_layers or 1
    if w.recompute == "full" and w.recompute_method == "uniform":
        stored, transient = math.ceil(chunk_layers / n) * ckpt, min(n, chunk_layers) * per_layer
        how = f"full recompute, uniform groups of {n}"
    elif w.recompute == "full":  # "block": the first n layers of every chunk are recomputed
        k = min(n, chunk_layers)
        stored, transient = k * ckpt + (chunk_layers - k) * per_layer, per_layer if k else 0.0
        how = f"full recompute of {k} of {chunk_layers} layers per chunk"
    else:
        mean = sum(w.first_chunks) / len(w.first_chunks) if w.first_chunks else chunk_layers  # chunks take turns
        stored, transient = mean * per_layer, 0.0
        how = (
            "no recompute" if w.recompute is None else f"selective ({', '.join(w.recompute_modules or ['core_attn'])})"
        )
    chunks = in_flight_chunks(w)
    shown = f"{stored / per_layer:.3g}" if per_layer and w.first_chunks else chunk_layers
    note = f"{per_layer / 2**20:.0f} MB/layer × {shown} layers × {chunks} in flight; {how}"
    return chunks * stored + transient, note


def estimate_workload(w: Workload, gpu: str = DEFAULT_GPU, hbm_gb: float | None = None) -> MemoryEstimate:
    """hbm_gb: the card's total memory when measured (torch.cuda.mem_get_info), else the GPU's (sizing/hardware.py)."""
    layers = first_stage_layers(w)[1]
    two = w.pp == 1 and not w.tied  # the untied output layer sits on the first stage too when PP=1
    emb, emb_what = w.vocab * w.hidden * (1 + two), "embedding + output layer" if two else "embedding"
    layer_params = layers * w.shape.layer_split[0]  # non-expert (all of a dense layer): split by TP
    experts = layers * w.shape.layer_split[1] // (w.ep * w.etp)  # routed experts: split by EP·ETP
    params = (layer_params + emb) // w.tp + experts
    fp8 = w.dtype == "fp8"
    wbytes = (2 if w.fp8_param_gather else 4) if fp8 else 2
    gbytes = 4 if w.grad_fp32 else 2
    shard = w.dp * w.cp if w.distributed_optimizer else 1
    eshard = w.expert_dp if w.distributed_optimizer else 1  # expert states: sharded over expert-DP
    act, act_note = activation_bytes(w)
    tokens = w.seq * w.mbs // w.cp
    # Native (unfused) cross entropy keeps BF16 logits, their fp32 copy and the fp32 softmax: 10 B per logit.
    per_logit = 4 if w.fused_cross_entropy else 10
    logits = tokens * (4 * w.hidden + per_logit * w.vocab) / w.tp if w.pp == 1 else 0.0
    ub = sum(tokens * w.hidden * (1 if fp8 and n in UB_ALL_GATHER else 2) for n in UB_BUFFERS) if w.tp_overlap else 0
    notes = {
        "weights": f"{params / 1e9:.2f}B params/GPU ({layers} layers + {emb_what}, /TP{w.tp}"
        + (f"; experts {experts / 1e9:.2f}B, /EP{w.ep}·ETP{w.etp}" if experts else "")
        + f") × {wbytes} B{' (FP8 + transpose)' if fp8 and w.fp8_param_gather else ''}",
        "grads": f"× {gbytes} B ({'fp32' if w.grad_fp32 else 'bf16'} DDP grad buffer)",
        "optimizer": f"× 12 B / {shard} (fp32 master + Adam m, v; "
        + (f"distributed over DP{w.dp}·CP{w.cp}" if w.distributed_optimizer else "not distributed")
        + (f"; experts' over expert-DP{eshard})" if experts else ")"),
        "activations": act_note,
        "logits": "fp32 logits + loss inputs (PP=1)" if logits else "on the last stage (PP>1)",
        "comm_buffers": f"{len(UB_BUFFERS)} userbuffers of {tokens}×{w.hidden}" if ub else "no TP overlap",
        "reserve": "CUDA context, NCCL communicators, cuBLAS/TE workspaces",
    }
    return MemoryEstimate(
        weights_gb=((layer_params * wbytes + emb * 2) / w.tp + experts * wbytes) / GB if fp8 else params * 2 / GB,
        grads_gb=params * gbytes / GB,
        optimizer_gb=((params - experts) * 12 / shard + experts * 12 / eshard) / GB,
        activations_gb=act / GB,
        logits_gb=logits / GB,
        comm_buffers_gb=ub / GB,
        reserve_gb=RESERVE_GB,
        hbm_gb=hbm_gb or HARDWARE[gpu].hbm_gb,
        margin_gb=MARGIN_GB,
        params_per_gpu=params,
        notes=notes,
        gpu=gpu,
    )
