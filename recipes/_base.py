"""What every H100 recipe shares: the layout knobs, the precision and the overlap stack, and `register`, the
registry's decorator with the recipe's overlap intent stated once (the builders below apply the intent registered).

A recipe file only names its Bridge base function, its layout, and what differs. Forking a size = one small file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.mixed_precision import bf16_mixed, bf16_with_fp8_current_scaling_mixed

from overlapkit.bridge import registry
from overlapkit.bridge.overlap import apply_overlap_stack
from overlapkit.bridge.registry import EnvVar
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.topology import Layout

DTYPES = ("bf16", "fp8cs")


@dataclass(frozen=True)
class MoE:
    """The MoE knobs NVIDIA's H100 perf recipes tune beside the layout."""

    dispatcher: str  # model.moe_token_dispatcher_type: "alltoall" or "flex"
    backend: str | None = None  # flex backend ("hybridep", "deepep"); None with alltoall
    recompute_modules: tuple[str, ...] | None = None  # selective recompute of these; None: no recompute


def precision(dtype: str):
    """BF16, or FP8 current scaling (per-tensor) with every layer in FP8, as NVIDIA's H100 perf recipes run it
    (megatron/bridge/perf_recipes/_common.py `_perf_precision("fp8_cs")` sets first_last_layers_bf16=False)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "bf16":
        return bf16_mixed()
    mp = bf16_with_fp8_current_scaling_mixed()
    mp.first_last_layers_bf16 = False
    return mp


# The intent of the recipe being built, for h100_pretrain: what `register` recorded for it.
_INTENT: ContextVar[OverlapIntent | None] = ContextVar("intent", default=None)


def register(*, intent: OverlapIntent | None = None, perf: str | None = None, **entry):
    """registry.register, the recipe's `intent` applied by the builders below while it builds (so stated once), and
    with `perf`, the module of NVIDIA's perf recipe of the same name, as its source (`<perf>.<name>_config`)."""

    def wrap(build: Callable[[], ConfigContainer]):
        @functools.wraps(build)
        def built() -> ConfigContainer:
            token = _INTENT.set(intent)
            try:
                return build()
            finally:
                _INTENT.reset(token)

        source = {"source": f"{perf}.{build.__name__}_config"} if perf else {}
        return registry.register(intent=intent, **source, **entry)(built)

    return wrap


def h100_pretrain(
    base: Callable[[], ConfigContainer], dtype: str, layout: Layout, intent: OverlapIntent | None = None
) -> ConfigContainer:
    """Bridge base recipe → our dtype and layout → the full overlap stack for `intent` (default: the one the recipe
    being built registered; none: every overlap on, presets selected by shape)."""
    intent = intent or _INTENT.get()
    cfg = base()
    cfg.mixed_precision = precision(dtype)
    m = cfg.model
    # Megatron Core 0.19 names the captured modules cuda_graph_modules; Bridge's base recipes still write the
    # deprecated cuda_graph_scope, which __post_init__ migrates. Set the current field, clear the old one; no graphs,
    # no modules (as _benchmark_common in megatron/bridge/perf_recipes/_common.py clears them).
    scope = m.cuda_graph_modules if m.cuda_graph_scope is None else m.cuda_graph_scope
    m.cuda_graph_scope = None
    modules = [] if m.cuda_graph_impl == "none" or scope in (None, "full") else scope
    m.cuda_graph_modules = [modules] if isinstance(modules, str) else list(modules)
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = layout.tp, layout.pp
    m.context_parallel_size, m.virtual_pipeline_model_parallel_size = layout.cp, layout.vpp
    m.expert_model_parallel_size = layout.ep
    if layout.etp is not None:
        m.expert_tensor_parallel_size = layout.etp
    m.pipeline_dtype = torch.bfloat16 if layout.pp > 1 else None
    if layout.seq is not None:
        m.seq_length = cfg.dataset.seq_length = layout.seq
    cfg.train.micro_batch_size, cfg.train.global_batch_size = layout.mbs, layout.gbs
    if cfg.tokenizer.tokenizer_type == "NullTokenizer" and m.vocab_size:
        # Mock-data runs: keep the real model's vocabulary (NVIDIA's perf recipes set 128256 for Llama3) so the
        # output layer, and so step time and TFLOP/s, match the published numbers.
        cfg.tokenizer.vocab_size = m.vocab_size
    return apply_overlap_stack(cfg, intent)


def with_shape(base: Callable[[], ConfigContainer], shape: dict) -> Callable[[], ConfigContainer]:
    """`base` with these model fields set (`num_layers=48, ...`): a forked recipe's Bridge base function, its FROM
    recipe's base with the new shape. Named `base` in the forked file, so the fork can be forked in turn."""

    def shaped() -> ConfigContainer:
        cfg = base()
        for key, value in shape.items():
            setattr(cfg.model, key, value)
        return cfg

    return shaped


# HybridEP kernels' SM budget in NVIDIA's perf recipes (megatron/bridge/perf_recipes/_common.py `_benchmark_common`).
HYBRIDEP_SMS = 32
_QWEN = "megatron.bridge.perf_recipes.qwen.h100.qwen3_moe"
_TOPOLOGY = f"HybridEP's NVLink-domain topology on 8-GPU H100 nodes, as in {_QWEN}"
# Read by DeepEP's HybridEPBuffer only (megatron/bridge/perf_recipes/environment.py HYBRID_EP_ENV_NAMES).
HYBRIDEP_ENV = {
    "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": EnvVar(8, _TOPOLOGY),
    "NVLINK_DOMAIN_SIZE": EnvVar(8, _TOPOLOGY),
    "USE_MNNVL": EnvVar(0, f"no multi-node NVLink on H100 (HGX nodes), as in {_QWEN}"),
    "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": EnvVar(
        128, f"HybridEP combine chunk of NVIDIA's measured baseline ({_QWEN})"
    ),
}


def moe_pretrain(
    base: Callable[[], ConfigContainer], dtype: str, layout: Layout, moe: MoE, intent: OverlapIntent | None = None
) -> ConfigContainer:
    """An MoE base recipe at NVIDIA's H100 layout with its dispatcher, fused kernels and recompute, then the overlap
    stack (EP all-to-all overlap included, bridge/overlap.py). Routing stays the learned router's: the perf recipes'
    moe_router_force_load_balancing is a benchmark device (tests/unit_tests/recipes/test_moe_recipes.py lists it)."""

    def tuned() -> ConfigContainer:
        cfg = base()
        m = cfg.model
        m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend = moe.dispatcher, moe.backend
        if moe.backend == "hybridep":
            m.moe_hybridep_num_sms = HYBRIDEP_SMS
        if moe.dispatcher == "flex":  # Megatron Core runs the shared experts inside the flex dispatch, not beside it
            m.moe_shared_expert_overlap = False
        # Fused kernels of the perf recipes: router, bias+activation, RoPE, TE's fused cross entropy.
        m.moe_router_fusion = m.bias_activation_fusion = m.apply_rope_fusion = True
        m.cross_entropy_loss_fusion, m.cross_entropy_fusion_impl = True, "te"
        m.recompute_granularity = "selective" if moe.recompute_modules else None
        m.recompute_modules = list(moe.recompute_modules) if moe.recompute_modules else None
        m.recompute_method = m.recompute_num_layers = None
        m.sequence_parallel = layout.tp > 1  # nothing to split at TP=1 (the perf recipes say False)
        return cfg

    return h100_pretrain(tuned, dtype, layout, intent)
