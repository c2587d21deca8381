"""What every H100 recipe shares: the layout knobs, the precision and the overlap stack; `register` (overlapkit's
registry) records the entry and the recipe's overlap intent.

A recipe file only names its Bridge base function, its layout, and what differs. Forking a size = one small file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.training.mixed_precision import bf16_mixed, bf16_with_fp8_current_scaling_mixed

from overlapkit.plan.overlap import OverlapIntent, apply_overlap_stack
from overlapkit.plan.registry import EnvVar, current_intent, register

DTYPES = ("bf16", "fp8cs")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    vpp: int | None
    mbs: int
    gbs: int
    seq: int | None = None  # None: keep the base recipe's sequence length


def precision(dtype: str):
    """BF16, or FP8 current scaling (per-tensor) with every layer in FP8, as NVIDIA's H100 perf recipes run it
    (megatron/bridge/perf_recipes/_common.py `_perf_precision("fp8_cs")` sets first_last_layers_bf16=False)."""
    if dtype == "bf16":
        return bf16_mixed()
    if dtype == "fp8cs":
        mp = bf16_with_fp8_current_scaling_mixed()
        mp.first_last_layers_bf16 = False
        return mp
    raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def h100_pretrain(base: Callable[[], ConfigContainer], dtype: str, layout: Layout) -> ConfigContainer:
    """Bridge base recipe → our dtype and layout → the full overlap stack, for the intent the recipe registered."""
    cfg = base()
    cfg.mixed_precision = precision(dtype)
    m = cfg.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = layout.tp, layout.pp
    m.context_parallel_size, m.virtual_pipeline_model_parallel_size = layout.cp, layout.vpp
    m.pipeline_dtype = torch.bfloat16 if layout.pp > 1 else None
    if layout.seq is not None:
        m.seq_length = cfg.dataset.seq_length = layout.seq
    cfg.train.micro_batch_size, cfg.train.global_batch_size = layout.mbs, layout.gbs
    if cfg.tokenizer.tokenizer_type == "NullTokenizer" and m.vocab_size:
        # Mock-data runs: keep the real model's vocabulary (NVIDIA's perf recipes set 128256 for Llama3) so the
        # output layer, and so step time and TFLOP/s, match the published numbers.
        cfg.tokenizer.vocab_size = m.vocab_size
    return apply_overlap_stack(cfg, current_intent())


__all__ = [
    "DTYPES",
    "EnvVar",
    "Layout",
    "OverlapIntent",
    "h100_pretrain",
    "precision",
    "register",
]
