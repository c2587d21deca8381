"""Model FLOPs of a config as Bridge counts them, split by the rate each part runs at (sizing/throughput.py's Flops,
which bridge/build.py hands to the prediction). Bridge's own `num_floating_point_operations`
(megatron/bridge/training/utils/flop_utils.py, the number behind `log_throughput`) is the count, never restated here.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

from overlapkit.sizing.throughput import Flops


def _bridge_flops(model, **changes) -> float:
    """Bridge's count for a copy of `model` with `changes` made."""
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

    model = copy.copy(model)
    for name, value in changes.items():
        setattr(model, name, value)
    # What it reads of a ConfigContainer: the model provider, and peft (none).
    return float(num_floating_point_operations(SimpleNamespace(model=model, peft=None), 1))


def flops_of_config(cfg) -> Flops:
    """Split Bridge's count for a ConfigContainer: at 2·seq (per token, only core attention grows), with the
    vocabulary grown by one padding multiple (only the output layer grows, linearly in the padded size) and at
    top-k + 1 (only the routed experts grow, linearly in k)."""
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    m = copy.copy(cfg.model)
    if not m.vocab_size:  # GPT3's provider leaves the vocabulary to the tokenizer, as at runtime
        m.vocab_size = cfg.tokenizer.vocab_size
    if m.kv_channels is None:  # megatron-core's default, set at finalize(), which a plan never runs
        m.kv_channels = m.hidden_size // m.num_attention_heads
    total = _bridge_flops(m)
    long = _bridge_flops(m, seq_length=2 * m.seq_length)
    attention = m.seq_length * (long / (2 * m.seq_length) - total / m.seq_length)
    step = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
    padded = calculate_padded_vocab_size(
        m.vocab_size, m.make_vocab_size_divisible_by, m.tensor_model_parallel_size, logging_enabled=False
    )
    logits = (_bridge_flops(m, vocab_size=m.vocab_size + step) - total) / step * padded
    experts = 0.0
    if getattr(m, "num_moe_experts", None):  # Bridge's routed-expert FLOPs are linear in the top-k
        experts = (_bridge_flops(m, moe_router_topk=m.moe_router_topk + 1) - total) * m.moe_router_topk
    return Flops(total, attention, logits, experts)
