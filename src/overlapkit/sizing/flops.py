"""Model FLOPs of a config, a model provider or a ModelShape, as Bridge counts them, split by the rate each part runs
at (sizing/throughput.py).

Bridge's own `num_floating_point_operations` (megatron/bridge/training/utils/flop_utils.py, the number behind
`log_throughput`) is the count, never restated here. It is evaluated again to split it: at twice the sequence
length (what grows with s² is core attention), with the vocabulary grown by one padding multiple (the output layer)
and at top-k + 1 (the routed experts).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


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
