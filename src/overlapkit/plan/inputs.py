"""What a user types, checked before the Bridge import (about 50 s here), and the one table of size rules.

NODES, SET (syntax, known keys, value types, sizes, no credentials) and recipe names are answered in well under a
second. SET is checked against the recorded schema (overrides.schema(), plan/config_schema.json): every
`section.field` of the shipped recipes' ConfigContainers with the kinds its annotation allows. `python -m
overlapkit.plan.inputs --record` rewrites it; a test fails when the installed Bridge disagrees with the file. What
the schema cannot decide (a key it has not recorded, or a Bridge other than the recorded one) is left to the full
check after the import, so nothing valid is refused early.

`SIZES` is the one home of "must be positive": checked here on SET values and, by the plan, on the built config
(a fork's file or a base recipe), before anything divides by them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing

from overlapkit import stack
from overlapkit.plan import overrides
from overlapkit.secrets import credential_kind

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
}


def size_problem(key: str, value) -> str | None:
    """One line when `value` breaks `key`'s size rule, else None."""
    if key not in SIZES:
        return None
    low, none_ok = SIZES[key]
    if value is None and none_ok:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return None
    allowed = f"a whole number ≥ {low}" + (" or null" if none_ok else "")
    return f"{key}={value!r}: must be {allowed}"


def size_problems(cfg) -> list[str]:
    """Every size rule the built config breaks (sections the recipe does not have are skipped)."""
    out = []
    for key in SIZES:
        section, leaf = key.split(".")
        obj = getattr(cfg, section, None)
        if obj is not None and hasattr(obj, leaf) and (msg := size_problem(key, getattr(obj, leaf))):
            out.append(msg)
    return out


def _whole(text: str) -> int | None:
    """`text` as a whole number ≥ 1, else None."""
    return int(text) if text.strip().isdigit() and int(text) >= 1 else None


def parse_nodes(text: str) -> int | None:
    """NODES= (empty: the recipe's)."""
    if not (text or "").strip():
        return None
    if (n := _whole(text)) is None:
        raise ValueError(f"NODES={text!r}: must be a whole number ≥ 1 of 8-GPU nodes")
    return n


def positive_int(text: str) -> int:
    """argparse type for a size flag (make new-recipe LAYERS= HIDDEN= ..., make nightly ITERS=)."""
    if (n := _whole(text)) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1")
    return n


# --- SET against the recorded schema (overrides.schema) ---------------------------------------------------


def check_sets(text) -> list[tuple[str, str]]:
    """SET= before the import: syntax, overlap.* keys, then each recorded key's type and size, and no credentials.
    Returns the parsed pairs; raises OverrideError (one line)."""
    pairs = overrides.parse(text)
    _, config_pairs = overrides.split_intent(pairs)
    keys = overrides.schema()
    sections = {k.split(".")[0] for k in keys}
    for key, raw in config_pairs:
        if kind := credential_kind(raw):
            raise overrides.OverrideError(
                f"{key}=<{kind}>: never put a credential in SET (it is written to "
                "plan.json and the job script); export it and list its name in the "
                "profile's secrets"
            )
        if key in keys:
            value = overrides.convert(key, raw)
            if msg := size_problem(key, value):
                raise overrides.OverrideError(msg)
        elif key.split(".")[0] in sections and key.count(".") == 1:
            close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
            raise overrides.OverrideError(f"unknown key {key!r}" + (f"; did you mean {close[0]}?" if close else ""))
    return pairs


def _kinds(tp) -> tuple[list[str], list]:
    """(kinds, choices) an annotation allows."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return ["none"], []
    if origin in (typing.Union, types.UnionType):
        parts = [_kinds(a) for a in args]
        return sorted({k for p, _ in parts for k in p}), []
    if origin is typing.Literal:
        return sorted({overrides.kind_of(v) for v in args}), list(args)
    if tp in (bool, int, float, str):
        return [tp.__name__], []
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        return ["list"], []
    if origin is dict or tp is dict:
        return ["dict"], []
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return ["object"], []
    return ["any"], []


def record(cfgs) -> dict:
    """The schema of these ConfigContainers: each section's dataclass fields, kinds from the type annotations."""
    keys: dict[str, dict] = {}
    for cfg in cfgs:
        for section in overrides.fields_of(cfg):
            obj = getattr(cfg, section)
            if not dataclasses.is_dataclass(obj):
                continue
            try:
                hints = typing.get_type_hints(type(obj))
            except Exception:  # an annotation that does not resolve outside its package: accept any value
                hints = {}
            for f in dataclasses.fields(obj):
                kinds, choices = _kinds(hints[f.name]) if f.name in hints else (["any"], [])
                entry = keys.setdefault(f"{section}.{f.name}", {"kinds": []})
                entry["kinds"] = sorted(set(entry["kinds"]) | set(kinds))
                if choices:
                    entry["choices"] = choices
    return {"versions": stack.versions(overrides.SCHEMA_PACKAGES), "keys": dict(sorted(keys.items()))}


def shipped_schema() -> dict:
    """record() over every shipped recipe (imports Bridge)."""
    from overlapkit.plan import registry

    with stack.silenced():
        return record(registry.get(n).build() for n in registry.names() if registry.shipped(n))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m overlapkit.plan.inputs --record")
    stack.import_bridge()
    overrides.SCHEMA_FILE.write_text(json.dumps(shipped_schema(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {stack.repo_relative(overrides.SCHEMA_FILE)}")
