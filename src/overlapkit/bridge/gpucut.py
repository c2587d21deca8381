"""1-GPU cuts of the dense recipes, next to the same cut of Bridge's own H100 recipe (issue #6, item 5).

A cut keeps what makes a recipe's GEMMs what they are (hidden, FFN, heads, query groups, vocabulary, dtype, every
knob that is not a layout knob) and changes only what one GPU forces: a few layers, TP = PP = CP = 1 (no overlap),
MBS 1, a short run on mock data with a fixed seed. Both sides get the identical cut: the ratio isolates the knobs.

Without Transformer Engine (the lent GPU machines cannot carry its wheel), the cut runs Megatron Core's local layer
spec in BF16 with the TE-only fusions off (unfused attention stores s² scores, hence the shorter sequence): its
TFLOP/s are a regression signal for this stack, labelled as such, never comparable to NVIDIA's published TE numbers.

Pure: the builders read no files and no environment; bench/gpu_cut.py runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass

from overlapkit.bridge import registry
from overlapkit.bridge.build import workload_of
from overlapkit.sizing import memory
from overlapkit.spec.topology import DEFAULT_GPU, Layout, Target

ITERS = 20
LABEL = "1 GPU · BF16 · Megatron Core local spec (no TE): unfused attention, native cross entropy"
SIDES = ("ours", "bridge")


# One GPU: no model parallelism, MBS 1. Sequence 2048: unfused attention stores s² scores per head, and 8192 would not
# fit one layer of 70B. GBS 4: microbatches per step at DP=1, enough to amortise the optimizer step.
ONE_GPU = Layout(tp=1, pp=1, cp=1, vpp=None, mbs=1, gbs=4, seq=2048)


@dataclass(frozen=True)
class Cut:
    """One dense recipe's 1-GPU cut. `reference`: the dotted path of Bridge's own H100 recipe function."""

    recipe: str
    reference: str
    layers: int
    layout: Layout = ONE_GPU
    note: str = ""

    @property
    def key(self) -> str:
        return self.recipe.split("_pretrain_")[0]  # the model: llama3_8b


_PERF = "megatron.bridge.perf_recipes.llama.h100"
# Sizes from memory.py's estimate with unfused attention: as many layers as fit an H100 80 GB at sequence 2048, except
# 405B: one layer (3.2B params) plus its untied 128K-vocab embedding and output layer (4.2B) at 16 B/param (BF16
# weights and grads, fp32 Adam) is 110 GB before any activation, so it runs on an H200 and is skipped on smaller cards.
CUTS = {
    c.key: c
    for c in (
        Cut("llama3_8b_pretrain_8gpu_h100_bf16", f"{_PERF}.llama3.llama3_8b_pretrain_8gpu_h100_bf16_config", 4),
        Cut("llama3_70b_pretrain_64gpu_h100_bf16", f"{_PERF}.llama3.llama3_70b_pretrain_64gpu_h100_bf16_config", 2),
        Cut(
            "gpt3_175b_pretrain_128gpu_h100_bf16",
            "megatron.bridge.recipes.gpt.h100.gpt3_175b.gpt3_175b_pretrain_32gpu_h100_bf16_config",
            layers=2,
            note="Bridge ships no GPT3 perf recipe: the reference is Bridge's own H100 GPT3 recipe",
        ),
        Cut(
            "llama31_405b_pretrain_512gpu_h100_bf16",
            f"{_PERF}.llama31.llama31_405b_pretrain_512gpu_h100_bf16_config",
            layers=1,
            note="H200 only: 110 GB of weights, grads and Adam state at one layer",
        ),
    )
}


def build(key: str, side: str, iters: int = ITERS):
    """The cut config of `key` (a CUTS key) for one side: the full recipe that side starts from (our registered
    recipe, or Bridge's own H100 recipe), turned into the 1-GPU, no-TE cut."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.enums import AttnBackend

    if key not in CUTS:
        raise KeyError(f"unknown cut {key!r}: use one of {', '.join(CUTS)}")
    cut = CUTS[key]
    if side == "ours":
        cfg = registry.get(cut.recipe).build()
    elif side == "bridge":
        module, _, function = cut.reference.rpartition(".")
        cfg = getattr(importlib.import_module(module), function)()
    else:
        raise ValueError(f"unknown side {side!r}: use one of {', '.join(SIDES)}")
    m, lay = cfg.model, cut.layout
    m.num_layers = cut.layers
    m.seq_length = cfg.dataset.seq_length = lay.seq
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size = lay.tp, lay.pp, lay.cp
    m.virtual_pipeline_model_parallel_size, m.pipeline_dtype = lay.vpp, None
    m.sequence_parallel = False
    m.account_for_embedding_in_pipeline_split = m.account_for_loss_in_pipeline_split = False
    m.num_layers_in_first_pipeline_stage = m.num_layers_in_last_pipeline_stage = None
    if m.recompute_num_layers:  # "block" recompute of N layers cannot name more layers than the cut has
        m.recompute_num_layers = min(m.recompute_num_layers, cut.layers)
    # No Transformer Engine: megatron-core's local spec, and every fusion whose kernel lives in TE (or apex) off.
    m.transformer_layer_spec = local_layer_spec
    m.use_transformer_engine_full_layer_spec = m.use_transformer_engine_op_fuser = False
    m.attention_backend = AttnBackend.local
    m.apply_rope_fusion = m.gradient_accumulation_fusion = m.persist_layer_norm = False
    m.masked_softmax_fusion = False  # megatron's scaled_masked_softmax CUDA extension is not in the wheel
    m.cross_entropy_loss_fusion, m.cross_entropy_fusion_impl = False, "native"
    m.tp_comm_overlap = False
    m.cuda_graph_impl, m.cuda_graph_modules, m.cuda_graph_scope = "none", [], None
    m.use_te_rng_tracker = cfg.rng.te_rng_tracker = False
    m.fp8 = None
    # GPT3's LayerNorm1p (zero-centred gamma) exists only in TE/apex norms; torch's LayerNorm, which the local spec
    # uses without apex, rejects it. Same FLOPs and memory with plain gamma: only the parametrisation differs.
    m.layernorm_zero_centered_gamma = False
    cfg.comm_overlap = None  # one GPU: no TP/PP/DP communication to overlap
    cfg.train.micro_batch_size, cfg.train.global_batch_size = lay.mbs, lay.gbs
    cfg.train.train_iters, cfg.train.eval_iters = iters, 0
    cfg.scheduler.lr_warmup_iters = min(cfg.scheduler.lr_warmup_iters, max(1, iters // 4))
    cfg.scheduler.lr_decay_iters = iters
    cfg.rng.seed = 1234
    cfg.logger.log_interval, cfg.logger.log_throughput = 1, True
    cfg.logger.tensorboard_dir = cfg.logger.wandb_project = None
    cfg.checkpoint.save = cfg.checkpoint.load = cfg.checkpoint.pretrained_checkpoint = None
    return cfg


def estimate(cfg, gpu: str = DEFAULT_GPU, hbm_gb: float | None = None) -> memory.MemoryEstimate:
    """Memory estimate of a cut config on one GPU (unfused attention, native cross entropy, no userbuffers)."""
    w = workload_of(cfg, Target(nodes=1, gpus_per_node=1, te_available=False))  # no TE: no userbuffers
    w = dataclasses.replace(w, attention="unfused", fused_cross_entropy=False)
    return memory.estimate_workload(w, gpu, hbm_gb)


SECTIONS = ("model", "train", "optimizer", "scheduler", "ddp", "mixed_precision", "tokenizer", "dataset", "rng")


def _plain(v):
    """A comparable, printable form: functions by name, everything else as is."""
    return getattr(v, "__qualname__", None) or v if callable(v) and not isinstance(v, type) else v


def differences(a, b) -> list[tuple[str, object, object]]:
    """(section.field, a's value, b's value) for every config field where two cut configs differ at training time:
    the knobs that can explain a ratio other than 1. Each side's mixed_precision is applied first (as Bridge's
    runtime_config_update does), so a value that precision would overwrite is not reported."""
    a, b = copy.deepcopy(a), copy.deepcopy(b)
    for c in (a, b):
        if dataclasses.is_dataclass(c.mixed_precision):
            c.mixed_precision.setup(c.model, c.optimizer, c.ddp)
    out = []
    for section in SECTIONS:
        x, y = getattr(a, section, None), getattr(b, section, None)
        if not (dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y)):
            if x != y:
                out.append((section, x, y))
            continue
        for f in (f for f in dataclasses.fields(x) if not f.name.startswith("_")):
            va, vb = _plain(getattr(x, f.name, None)), _plain(getattr(y, f.name, None))
            if type(va) is not type(vb) or va != vb:
                out.append((f"{section}.{f.name}", va, vb))
    return out
