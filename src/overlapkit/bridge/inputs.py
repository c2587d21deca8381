"""What a user types, checked before the Bridge import (docs/architecture.md: measured facts), and the size rules.

NODES, SET (syntax, the overlap.* keys, values that are no value, the sizes and signs below, no credentials) and
recipe names are answered in well under a second. Whether any other key exists and what its field holds is Bridge's
to say after the import (overrides.apply: its override path on the live config), so nothing valid is refused early.

`SIZES` is the one home of "must be positive": checked here on SET values and, by the plan, on the built config
(a fork's file or a base recipe), before anything divides by them.
"""

from __future__ import annotations

from overlapkit.bridge import overrides
from overlapkit.errors import BadInput
from overlapkit.secrets import credential_kind
from overlapkit.spec import runopts
from overlapkit.spec.shape import head_dim_follows, head_dim_problem

# key: (smallest allowed value, whether null is allowed). Null means "off" or "Bridge's default" where allowed.
SIZES: dict[str, tuple[int, bool]] = {
    "model.tensor_model_parallel_size": (1, False),
    "model.pipeline_model_parallel_size": (1, False),
    "model.context_parallel_size": (1, True),
    "model.virtual_pipeline_model_parallel_size": (1, True),
    "model.expert_model_parallel_size": (1, True),
    "model.expert_tensor_parallel_size": (1, True),
    "model.num_layers": (1, False),
    "model.hidden_size": (1, False),
    "model.num_attention_heads": (1, False),
    "model.num_query_groups": (1, True),
    "model.ffn_hidden_size": (1, False),
    "model.kv_channels": (1, True),
    "model.num_moe_experts": (1, True),
    "model.seq_length": (1, False),
    "model.vocab_size": (1, True),
    "dataset.sequence_length": (1, True),
    "train.global_batch_size": (1, False),
    "train.micro_batch_size": (1, False),
    "train.train_iters": (1, True),
    "ddp.bucket_size": (1, True),
    "comm_overlap.bucket_size": (1, True),
    "scheduler.lr_warmup_iters": (0, True),
    "logger.log_interval": (1, True),
    "checkpoint.save_interval": (1, True),
    "validation.eval_iters": (0, True),
    "validation.eval_interval": (1, True),
    "model.moe_router_topk": (1, False),  # experts each token is routed to (≤ the experts: config_problems)
}
# The float settings with a sign, each with why: key: (lowest, whether the lowest itself is allowed, why). Null stays
# allowed where the field's type allows it. Every float is finite whatever its field (overrides.number_problem).
SIGNED: dict[str, tuple[float, bool, str]] = {
    "optimizer.lr": (0.0, False, "the step size: 0 trains nothing, a negative one climbs the loss"),
    "optimizer.min_lr": (0.0, True, "the learning rate the schedule decays to"),
    "scheduler.lr_warmup_init": (0.0, True, "the learning rate warmup starts from"),
    "optimizer.adam_eps": (0.0, False, "Adam divides by sqrt(v) + eps"),
    "optimizer.weight_decay": (0.0, True, "a negative decay grows the weights"),
    "optimizer.clip_grad": (0.0, True, "a bound on the gradient norm (0: no clipping)"),
    "model.init_method_std": (0.0, False, "a standard deviation"),
}
# Shape sizes beyond these are a typing error, not a model: each is 16× the largest value among the models this repo
# plans (Llama 3.1 405B: 126 layers, hidden 16384, FFN 53248, 128 heads, 131072 tokens of context; DeepSeek-V3:
# 256 experts, top-8 routing). A bound a number cannot make astronomical: the layout search walks the pipeline
# splits of the layers, and the memory and throughput models multiply these.
CEILINGS: dict[str, int] = {
    "model.num_layers": 16 * 126,
    "model.hidden_size": 16 * 16384,
    "model.ffn_hidden_size": 16 * 53248,
    "model.num_attention_heads": 16 * 128,
    "model.num_query_groups": 16 * 128,
    "model.seq_length": 16 * 131072,
    "model.num_moe_experts": 16 * 256,
    "model.moe_router_topk": 16 * 256,  # at most the experts (config_problems says so, naming them)
}
# NODES beyond this is a typing error, not a cluster: 8× the 16,384 H100s (2,048 nodes) that trained Llama 3 405B,
# the largest published H100 run ("The Llama 3 Herd of Models", Meta 2024, section 3.3.1).
MAX_NODES = 16384


def size_problem(key: str, value) -> str | None:
    """One line when `value` breaks `key`'s size or sign rule, else None."""
    if key in SIGNED:
        low, inclusive, why = SIGNED[key]
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None  # the field's type decides (overrides.convert)
        if value > low or (inclusive and value == low):
            return None
        return f"{key}={value!r}: must be {'≥' if inclusive else '>'} {low:g} ({why})"
    if key not in SIZES:
        return None
    low, none_ok = SIZES[key]
    if value is None and none_ok:
        return None
    high = CEILINGS.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return None
    allowed = f"a whole number ≥ {low}" + (f" and ≤ {high:,}" if high else "") + (" or null" if none_ok else "")
    return f"{key}={value!r}: must be {allowed}"


def size_problems(cfg) -> list[str]:
    """Every size and sign rule the built config breaks (on the sections and fields the recipe has)."""
    out = []
    for key in [*SIZES, *SIGNED]:
        section, leaf = key.split(".")
        obj = getattr(cfg, section, None)
        if obj is not None and hasattr(obj, leaf) and (msg := size_problem(key, getattr(obj, leaf))):
            out.append(msg)
    return out


def recipe_facts(cfg) -> dict:
    """What config_problems compares a SET with: the recipe's own head-dim rule and whether it has experts."""
    m = cfg.model
    return {
        "head_dim_follows": head_dim_follows(m.hidden_size, m.num_attention_heads, m.kv_channels),
        "experts": m.num_moe_experts,
    }


def config_problems(cfg, facts: dict, sets) -> list[str]:
    """The rules across fields, on the built config once SET is applied (`facts`: recipe_facts before it; `sets`: the
    SET keys): sizes and signs, a training length, the head dim, the experts."""
    m, t, keys = cfg.model, cfg.train, set(sets)
    out = size_problems(cfg)
    if t.train_iters is None and t.train_samples is None and getattr(t, "num_epochs", None) is None:
        # Bridge asserts it when the job starts (megatron/bridge/training/config.py, TrainingConfig.finalize)
        out.append(
            "train.train_iters=None: one of train.train_iters, train.train_samples, train.num_epochs must be set"
        )
    reshaped = "model.kv_channels" not in keys and {"model.hidden_size", "model.num_attention_heads"} & keys
    if facts["head_dim_follows"] and reshaped:
        if msg := head_dim_problem(m.hidden_size, m.num_attention_heads, None):
            out.append(
                f"model.hidden_size={m.hidden_size}, model.num_attention_heads={m.num_attention_heads}: {msg}; "
                "use a hidden size that divides by the heads, or SET model.kv_channels too"
            )
    if facts["experts"] and m.num_moe_experts is None:
        out.append(
            f"model.num_moe_experts=None: this recipe is a mixture of {facts['experts']} experts (its router, "
            "expert parallelism and overlaps need them); plan a dense recipe instead (make recipes)"
        )
    elif m.num_moe_experts and m.moe_router_topk > m.num_moe_experts:
        # the router takes torch.topk(scores, k=topk) over the experts (megatron/core/transformer/moe/moe_utils.py)
        out.append(
            f"model.moe_router_topk={m.moe_router_topk}: more than the {m.num_moe_experts} experts; "
            f"use 1..{m.num_moe_experts}"
        )
    return out


def parse_nodes(text: str) -> int | None:
    """NODES= (empty: the recipe's)."""
    if not (text or "").strip():
        return None
    if (n := runopts.whole(text)) is None or n < 1:
        raise BadInput(f"NODES={text!r}: must be a whole number of 8-GPU nodes from 1 to {MAX_NODES}")
    if n > MAX_NODES:
        raise BadInput(f"NODES={text!r}: at most {MAX_NODES} 8-GPU nodes (NODES is a node count, not GPUs)")
    return n


# --- SET before the import: the keys this module types ----------------------------------------------------------


def _early_kinds(key: str) -> set[str]:
    """What a SET value of `key` may be before the import: a size is a whole number (or null where SIZES allows it),
    a signed setting a number or null (its field's annotation says whether null is allowed, after the import); any
    other key any value (Bridge's field decides)."""
    if key in SIZES:
        return {"int", "none"} if SIZES[key][1] else {"int"}
    return {"float", "none"} if key in SIGNED else {"any"}


def check_sets(text) -> list[tuple[str, str]]:
    """SET= before the import: syntax, overlap.* keys, each value read (a number within int64, finite), the sizes and
    signs, and no credentials. Returns the parsed pairs; raises OverrideError (one line)."""
    pairs = overrides.parse(text)
    seen = [k for k, _ in pairs]
    if twice := next((k for i, k in enumerate(seen) if k in seen[:i]), None):
        raise overrides.OverrideError(f"{twice} is set twice in SET: keep one {twice}=<value>")
    _, config_pairs = overrides.split_intent(pairs)
    for key, raw in config_pairs:
        if kind := credential_kind(raw):
            msg = f"{key}=<{kind}>: never put a credential in SET (it is written to plan.json and the job script)"
            raise overrides.OverrideError(f"{msg}; export it and list its name in the profile's secrets")
        if msg := size_problem(key, overrides.convert_kinds(key, raw, _early_kinds(key))):
            raise overrides.OverrideError(msg)
    return pairs
