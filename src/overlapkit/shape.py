"""The one description of a dense GQA transformer's shape, and the parameter counts that follow from it.

Memory estimates, the layout search, the fork scaffold, the audit's bucket rule and the plan's parameter count all
read a `ModelShape`: built from a Bridge config with `ModelShape.of(cfg)`, or written out for a new size.
"""

from __future__ import annotations

from dataclasses import dataclass


def dtype_of(cfg) -> str:
    """ "fp8" when the config's mixed precision trains in FP8, else "bf16" (the presets' spelling)."""
    mp = cfg.mixed_precision
    return "fp8" if mp is not None and not isinstance(mp, str) and mp.fp8 else "bf16"


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

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape a Bridge ConfigContainer trains (GPT3's provider leaves the vocabulary to the tokenizer)."""
        m = cfg.model
        return cls(
            hidden=m.hidden_size, layers=m.num_layers, heads=m.num_attention_heads,
            query_groups=m.num_query_groups or m.num_attention_heads, ffn=m.ffn_hidden_size, seq=m.seq_length,
            vocab=m.vocab_size or cfg.tokenizer.vocab_size or 0, dtype=dtype_of(cfg), kv_channels=m.kv_channels,
            gated=bool(m.gated_linear_unit), tied=bool(m.share_embeddings_and_output_weights),
            dropout=bool(m.hidden_dropout), account_embedding=bool(m.account_for_embedding_in_pipeline_split),
            account_loss=bool(m.account_for_loss_in_pipeline_split),
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def pipeline_units(self) -> int:
        """Transformer layers plus the embedding/loss that Bridge accounts in an even pipeline split."""
        return self.layers + self.account_embedding + self.account_loss

    @property
    def params_per_layer(self) -> int:
        """Dense GQA transformer layer parameters (weights only; biases and norms are noise at these sizes)."""
        h, q, kv = self.hidden, self.head_dim * self.heads, self.head_dim * self.query_groups
        mlp = (3 if self.gated else 2) * h * self.ffn
        return h * (q + 2 * kv) + q * h + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params

    def chunk_params(self, tp: int, pp: int, vpp: int | None) -> int:
        """Parameters of one model chunk on one TP rank: what one DDP grad buffer holds on a middle pipeline stage."""
        return self.layers * self.params_per_layer // (pp * (vpp or 1)) // tp

    def describe(self) -> str:
        return (
            f"h{self.hidden} L{self.layers} heads{self.heads} groups{self.query_groups} ffn{self.ffn} "
            f"seq{self.seq} {self.dtype}"
        )
