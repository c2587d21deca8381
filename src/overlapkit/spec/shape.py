"""The one description of a transformer's shape (dense GQA, or mixture-of-experts with optional multi-latent
attention and multi-token prediction), and the parameter counts that follow from it.

Memory estimates, the layout search, the fork scaffold, the audit's bucket rule and the plan's parameter count all
read a `ModelShape`: built from a Bridge config with `ModelShape.of(cfg)`, or written out for a new size.
"""

from __future__ import annotations

from dataclasses import dataclass


def dtype_of(cfg) -> str:
    """ "fp8" when the config's mixed precision trains in FP8, else "bf16" (the presets' spelling)."""
    mp = cfg.mixed_precision
    return "fp8" if mp is not None and not isinstance(mp, str) and mp.fp8 else "bf16"


def head_dim_follows(hidden: int, heads: int, kv_channels: int | None) -> bool:
    """Is the head dim hidden / heads (kv_channels unset, or set to exactly that), so that a new hidden size or head
    count must carry it along? Not for a model whose head dim is its own (Qwen3: 128 on hidden 2048 / 32 heads;
    GPT-OSS: 64 on hidden 2880 / 64 heads)."""
    return not kv_channels or heads * kv_channels == hidden


def head_dim_problem(hidden: int, heads: int, kv_channels: int | None) -> str | None:
    """The one rule of the head dim (the fork and SET both apply it): where kv_channels is unset, Megatron derives it
    as hidden // heads (megatron/core/transformer/transformer_config.py, __post_init__: a floor, so hidden 4100 on 32
    heads silently trains 128-wide heads projecting 4096 of the 4100 features); such a hidden must divide by heads."""
    if not kv_channels and heads and hidden % heads:
        return f"hidden {hidden} is not divisible by heads {heads} (head dim)"
    return None


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    query_groups: int
    ffn: int
    seq: int
    vocab: int
    dtype: str = "bf16"  # "bf16" | "fp8" (presets' spelling; recipes say fp8cs)
    kv_channels: int | None = None
    gated: bool = True
    tied: bool = False
    dropout: bool = False
    account_embedding: bool = False  # Bridge's account_for_{embedding,loss}_in_pipeline_split
    account_loss: bool = False
    bias: bool = False  # add_bias_linear (GPT-OSS): biases on every linear layer, experts included
    # Mixture of experts (0 = dense). moe_layers: how many layers are MoE; the rest are dense with `ffn`.
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0  # shared experts' total FFN size (DeepSeek-V3: 1 × 2048)
    moe_layers: int = 0
    # Multi-latent attention (DeepSeek-V3): query/KV low ranks and head sizes; 0 = GQA.
    q_lora: int = 0
    kv_lora: int = 0
    qk_head: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape a Bridge ConfigContainer trains (GPT3's provider leaves the vocabulary to the tokenizer)."""
        m = cfg.model
        extra = {}  # the MoE and MLA fields
        if getattr(m, "num_moe_experts", None):
            freq = m.moe_layer_freq
            extra |= dict(
                experts=m.num_moe_experts,
                topk=m.moe_router_topk,
                moe_layers=sum(freq) if isinstance(freq, list) else len(range(0, m.num_layers, freq)),
                moe_ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size,
                shared_ffn=m.moe_shared_expert_intermediate_size or 0,
            )
        if getattr(m, "multi_latent_attention", False):
            extra |= dict(
                q_lora=m.q_lora_rank or 0,
                kv_lora=m.kv_lora_rank,
                qk_head=m.qk_head_dim,
                qk_rope=m.qk_pos_emb_head_dim,
                v_head=m.v_head_dim,
            )
        return cls(
            hidden=m.hidden_size,
            layers=m.num_layers,
            heads=m.num_attention_heads,
            query_groups=m.num_query_groups or m.num_attention_heads,
            ffn=m.ffn_hidden_size,
            seq=m.seq_length,
            vocab=m.vocab_size or cfg.tokenizer.vocab_size or 0,
            dtype=dtype_of(cfg),
            kv_channels=m.kv_channels,
            gated=bool(m.gated_linear_unit),
            tied=bool(m.share_embeddings_and_output_weights),
            dropout=bool(m.hidden_dropout),
            account_embedding=bool(m.account_for_embedding_in_pipeline_split),
            account_loss=bool(m.account_for_loss_in_pipeline_split),
            bias=bool(m.add_bias_linear),
            **extra,
        )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def pipeline_units(self) -> int:
        """Transformer layers plus the embedding/loss that Bridge accounts in an even pipeline split."""
        return self.layers + self.account_embedding + self.account_loss

    @property
    def attention_params(self) -> int:
        """Attention weights (GQA, or MLA with its low-rank projections and their norms), plus its norm."""
        h, a = self.hidden, self.heads
        if self.kv_lora:
            q_in = h * self.q_lora + self.q_lora if self.q_lora else 0
            q = (self.q_lora or h) * a * (self.qk_head + self.qk_rope) + q_in
            kv = h * (self.kv_lora + self.qk_rope) + self.kv_lora + self.kv_lora * a * (self.qk_head + self.v_head)
            return q + kv + a * self.v_head * h + h
        q, kv = self.head_dim * a, self.head_dim * self.query_groups
        bias = (q + 2 * kv + h) if self.bias else 0
        return h * (q + 2 * kv) + q * h + bias + h

    def mlp_params(self, ffn: int) -> int:
        """One (gated) MLP of width `ffn`, with biases when the model has them."""
        bias = (2 if self.gated else 1) * ffn + self.hidden if self.bias else 0
        return (3 if self.gated else 2) * self.hidden * ffn + bias

    @property
    def expert_params_per_moe_layer(self) -> int:
        """Routed experts of one MoE layer: what EP·ETP shards."""
        return self.experts * self.mlp_params(self.moe_ffn)

    @property
    def layer_split(self) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters per layer on average: TP shards the first, EP·ETP the second."""
        dense = self.layers - self.moe_layers
        dense_layer = self.attention_params + self.mlp_params(self.ffn) + self.hidden
        # An MoE layer's non-expert part: attention, router, shared experts, the MLP norm (its routed experts: the
        # second part).
        shared = self.mlp_params(self.shared_ffn) if self.shared_ffn else 0
        moe_layer = self.attention_params + self.hidden * self.experts + shared + self.hidden
        non_expert = dense * dense_layer + self.moe_layers * moe_layer
        return non_expert // self.layers, self.moe_layers * self.expert_params_per_moe_layer // self.layers

    @property
    def total_params(self) -> int:
        """The model card's total: every layer and the embeddings, MTP layers excluded."""
        embedding = self.vocab * self.hidden * (1 if self.tied else 2)
        return sum(self.layer_split) * self.layers + embedding + self.hidden  # + final norm

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the routed experts it is not sent to (it goes to top-k) and
        the input embedding (a lookup), as DeepSeek-V3's and gpt-oss's model cards count (Qwen3's cards add the
        embedding: active_params + vocab·hidden)."""
        idle = self.moe_layers * (self.experts - self.topk) * self.mlp_params(self.moe_ffn)
        return self.total_params - idle - self.vocab * self.hidden

    def chunk_params(self, tp: int, pp: int, vpp: int | None, ep_etp: int = 1) -> int:
        """Parameters of one model chunk on one rank: what its DDP grad buffers hold on a middle pipeline stage
        (non-expert parameters split by TP, routed experts by EP·ETP)."""
        non_expert, expert = self.layer_split
        return self.layers * (non_expert // tp + expert // ep_etp) // (pp * (vpp or 1))

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def describe(self) -> str:
        return (
            f"h{self.hidden} L{self.layers} heads{self.heads} groups{self.query_groups} ffn{self.ffn} "
            f"seq{self.seq} {self.dtype}"
        )
