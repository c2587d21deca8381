"""Model FLOPs of a config, a model provider or a ModelShape, as Bridge counts them, split by the rate each part runs
at (sizing/throughput.py's Flops, which bridge/build.py hands to the prediction).

Bridge's own `num_floating_point_operations` (megatron/bridge/training/utils/flop_utils.py, the number behind
`log_throughput`) is the count, never restated here. It is evaluated again to split it: at twice the sequence
length (what grows with s² is core attention), with the vocabulary grown by one padding multiple (the output layer)
and at top-k + 1 (the routed experts).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from overlapkit.sizing.throughput import Flops


def _bridge_flops(model) -> float:
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    return float(num_floating_point_operations(_Cfg(model), 1))


@dataclass
class _Cfg:
    """What num_floating_point_operations reads of a ConfigContainer: the model provider (and peft: none)."""

    model: object
    peft: object = None


def flops_of_model(model) -> Flops:
    """Split Bridge's count for a model provider: at 2·seq (per token, only core attention grows), with the
    vocabulary grown by one padding multiple (only the output layer grows, linearly in the padded size) and at
    top-k + 1 (only the routed experts grow, linearly in k)."""
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
    experts = 0.0
    if getattr(m, "num_moe_experts", None):  # Bridge's routed-expert FLOPs are linear in the top-k
        more = copy.copy(m)
        more.moe_router_topk = m.moe_router_topk + 1
        experts = (_bridge_flops(more) - total) * m.moe_router_topk
    return Flops(total, attention, logits, experts)


def flops_of_config(cfg) -> Flops:
    """For a Bridge ConfigContainer (GPT3's provider leaves the vocabulary to the tokenizer, as at runtime)."""
    m = copy.copy(cfg.model)
    if not m.vocab_size:
        m.vocab_size = cfg.tokenizer.vocab_size
    return flops_of_model(m)
