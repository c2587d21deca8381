"""Dotted overrides (`SET="train.global_batch_size=512 model.sequence_parallel=false"`) on a real ConfigContainer.

Values are parsed as YAML scalars and converted to the type of the field they replace; anything unknown or
ill-typed is a one-line OverrideError naming the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import shlex

import yaml

INTENT_PREFIX = "overlap."  # keys that change the overlap intent, not a config field (see OverlapIntent)


class OverrideError(ValueError):
    """One-line, user-facing."""


def parse(text: str | list[str] | None) -> list[tuple[str, str]]:
    tokens = shlex.split(text) if isinstance(text, str) else list(text or [])
    pairs = []
    for tok in tokens:
        key, sep, value = tok.partition("=")
        if not sep or not key:
            raise OverrideError(f"override {tok!r} is not KEY=VALUE (e.g. train.global_batch_size=512)")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _fields(obj) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return [k for k in vars(obj) if not k.startswith("_")] if hasattr(obj, "__dict__") else []


def valid_keys(root, prefix: str = "", depth: int = 2) -> list[str]:
    out = []
    for name in _fields(root):
        key = f"{prefix}{name}"
        out.append(key)
        child = getattr(root, name, None)
        if depth > 1 and dataclasses.is_dataclass(child):
            out += valid_keys(child, key + ".", depth - 1)
    return out


def _nearest(key: str, root) -> str:
    close = difflib.get_close_matches(key, valid_keys(root), n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


def convert(key: str, raw: str, current, field_type=None):
    """`raw` (YAML scalar text) converted to the type of `current`."""
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"{key}={raw!r}: not a valid value ({exc.problem})") from None
    if value is None:
        return None
    kind = type(current) if current is not None else None
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise OverrideError(f"{key}={raw!r}: expected true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise OverrideError(f"{key}={raw!r}: expected an integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise OverrideError(f"{key}={raw!r}: expected a number")
    if kind is str and not isinstance(value, str):
        return str(value)  # e.g. a time limit or path that YAML read as a number
    if kind in (list, tuple) and not isinstance(value, (list, tuple)):
        raise OverrideError(f"{key}={raw!r}: expected a list, e.g. [a, b]")
    if kind is not None and not isinstance(value, (str, int, float, bool, list, tuple, dict)):
        raise OverrideError(f"{key}={raw!r}: cannot set a {kind.__name__} from the command line")
    if kind is not None and kind not in (str, list, tuple, dict) and not isinstance(value, kind):
        raise OverrideError(f"{key}={raw!r}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def apply(cfg, pairs: list[tuple[str, str]]) -> list[tuple[str, object, object]]:
    """Set each dotted key on `cfg`. Returns (key, old, new) for the plan's record."""
    changes = []
    for key, raw in pairs:
        *path, leaf = key.split(".")
        obj = cfg
        for i, part in enumerate(path):
            if part not in _fields(obj):
                raise OverrideError(f"unknown key {key!r}: no {'.'.join(path[: i + 1])!r}{_nearest(key, cfg)}")
            obj = getattr(obj, part)
            if obj is None:
                raise OverrideError(f"cannot set {key!r}: {'.'.join(path[: i + 1])} is None in this recipe")
        if leaf not in _fields(obj):
            raise OverrideError(f"unknown key {key!r}{_nearest(key, cfg)}")
        old = getattr(obj, leaf)
        new = convert(key, raw, old)
        setattr(obj, leaf, new)
        changes.append((key, old, new))
    return changes


def split_intent(pairs: list[tuple[str, str]]) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """Separate `overlap.*` intent keys from config keys."""
    from overlapkit.plan.overlap import OverlapIntent

    intent, rest = {}, []
    names = [f.name for f in dataclasses.fields(OverlapIntent)]
    for key, raw in pairs:
        if not key.startswith(INTENT_PREFIX):
            rest.append((key, raw))
            continue
        name = key[len(INTENT_PREFIX) :]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {INTENT_PREFIX}{close[0]}?" if close else f" (known: {', '.join(names)})"
            raise OverrideError(f"unknown key {key!r}{hint}")
        default = getattr(OverlapIntent(), name)
        intent[name] = convert(key, raw, default if default is not None else "")
    return intent, rest
