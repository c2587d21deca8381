"""Dotted overrides (`SET="train.global_batch_size=512 model.sequence_parallel=false"`) on a real ConfigContainer.

Values are read as YAML scalars and checked against the annotation of the live field they replace; the keys are the
ones Bridge's own override path knows (megatron.bridge.training.utils.omegaconf_utils: the OmegaConf tree of the
config, which its scripts' dotted overrides address), and each value is set through its `apply_overrides`. Anything
unknown or ill-typed is a one-line OverrideError naming the nearest key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import math
import re
import shlex
import types
import typing
from functools import cache, reduce

import yaml

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.spec import runopts

INTENT_PREFIX = "overlap."  # keys that change the overlap intent, not a config field (see OverlapIntent)


class OverrideError(BadInput):
    """One-line, user-facing."""


def parse(text: str | list[str] | None) -> list[tuple[str, str]]:
    try:
        tokens = shlex.split(text) if isinstance(text, str) else list(text or [])
    except ValueError as exc:  # shlex: "No closing quotation"
        raise OverrideError(f"SET={text!r}: {exc}; quote a value with spaces as KEY='a b'") from None
    pairs = []
    for tok in tokens:
        key, sep, value = tok.partition("=")
        if not sep or not key:
            raise OverrideError(f"override {tok!r} is not KEY=VALUE (e.g. train.global_batch_size=512)")
        pairs.append((key.strip(), value.strip()))
    return pairs


_READABLE = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "none": "null"}
_READABLE |= {"list": "a list, e.g. [a, b]", "dict": "a mapping, e.g. {a: 1}"}


def kind_of(value) -> str:
    """The name of the kind of `value` (_READABLE's keys, and "object")."""
    if value is None:
        return "none"
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t.__name__
    return "list" if isinstance(value, (list, tuple)) else "dict" if isinstance(value, dict) else "object"


def _kinds(tp) -> tuple[list[str], list]:
    """(kinds, choices) an annotation allows."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return ["none"], []
    if origin in (typing.Union, types.UnionType):
        return sorted({k for a in args for k in _kinds(a)[0]}), []
    if origin is typing.Literal:
        return sorted({kind_of(v) for v in args}), list(args)
    if tp in (bool, int, float, str):
        return [tp.__name__], []
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        return ["list"], []
    if origin is dict or tp is dict:
        return ["dict"], []
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return ["object"], []
    return ["any"], []


@cache
def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve outside its package: any value
        return {}


def to_raw(value) -> str:
    """A value as SET text (the inverse of convert for scalars): null, true/false, or str()."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, each decimal integer it reads (a scalar, or one inside a list or dict) bounded on its digits
    first (jsonio.integer): 5,000 digits would reach Python's digit limit inside PyYAML's own int()."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node).replace("_", "").lstrip("+-")
        if not text.startswith(("0b", "0x")):  # int(text, 2 or 16) has no digit limit; number_problem bounds it
            for part in text.split(":"):  # YAML 1.1's base 60 (1:30 is 90): each part a decimal int()
                if jsonio.integer(part) is None:
                    shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
                    msg = f"{shown} is beyond the 64-bit integers Megatron stores (at most {runopts.INT64_MAX:,})"
                    raise yaml.constructor.ConstructorError(None, None, msg, node.start_mark)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def convert_kinds(key: str, raw: str, kinds: set[str], choices=None):
    """`raw` (YAML scalar text) as a value of one of `kinds` (a field's annotation's, or an intent default's)."""
    try:
        value = yaml.load(raw, Loader=_Loader) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"{key}={raw!r}: not a valid value ({exc.problem})") from None
    if isinstance(value, str) and "float" in kinds and _EXPONENT.fullmatch(raw):
        value = float(raw)  # 3e-4: YAML 1.1 reads an exponent without a dot as a string; YAML 1.2 and Python do not
    out = _as_kind(value, kinds)
    # YAML 1.1 reads 04:00:00 as sexagesimal seconds and 2026-12-03 as a date: a string field keeps what was typed.
    as_time = isinstance(value, (dt.date, dt.datetime)) or (isinstance(value, (int, float)) and ":" in raw)
    if out is _REFUSED and "str" in kinds and as_time:
        out = raw
    if out is _REFUSED:
        wanted = " or ".join(_READABLE[k] for k in sorted(kinds) if k in _READABLE) or "a value set in Python"
        # null, true/false or a number given to a text field is never the text "null", "false" or "0" (the audit
        # would pass a setting that means nothing): YAML's reading is refused, and quoting gives the text
        quote = f"; to mean the text, quote it inside SET: {key}=\"'{raw}'\"" if "str" in kinds else ""
        raise OverrideError(f"{key}={raw!r}: expected {wanted}, not {_READABLE.get(kind_of(value), 'this')}{quote}")
    if choices and out not in choices:
        raise OverrideError(f"{key}={raw!r}: expected one of {', '.join(map(str, choices))}")
    if msg := number_problem(out):
        raise OverrideError(f"{key}={raw!r}: {msg}")
    return out


def number_problem(value) -> str | None:
    """Why `value` (a converted SET value) is no number a config field can hold, else None. The rule follows from
    the kind, whatever the field: integers within int64 (runopts.INT64_MAX), and floats finite (no setting means
    anything as inf or nan; nan is not even equal to itself, so no later comparison could catch it)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) > runopts.INT64_MAX:
        return f"beyond the 64-bit integers Megatron stores (at most {runopts.INT64_MAX:,})"
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number (inf and nan are never a setting)"
    return None


_REFUSED = object()
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", re.ASCII)


def _as_kind(value, kinds: set[str]):
    if "any" in kinds:
        return value
    kind = kind_of(value)
    if kind == "int" and "float" in kinds and "int" not in kinds:
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float: number_problem names it
            return math.inf
    return value if kind != "object" and kind in kinds else _REFUSED  # no YAML value is a dataclass


def convert(key: str, raw: str, holder, leaf: str):
    """`raw` converted to the type of field `leaf` of the dataclass `holder` (its annotation; any value where that
    does not resolve)."""
    kinds, choices = _kinds(_hints(type(holder))[leaf]) if leaf in _hints(type(holder)) else (["any"], [])
    return convert_kinds(key, raw, set(kinds), choices)


def keys_of(node, prefix: str = "") -> list[str]:
    """Every dotted key of an OmegaConf tree (Bridge's view of a config: the keys its overrides address)."""
    from omegaconf import DictConfig

    out = []
    for name, child in node.items():
        out.append(f"{prefix}{name}")
        if isinstance(child, DictConfig):
            out += keys_of(child, f"{prefix}{name}.")
    return out


def _holder(cfg, keys: set[str], key: str):
    """The dataclass holding `key`'s field, walked on `cfg`; OverrideError for a key Bridge's tree (`keys`) lacks."""
    *path, leaf = key.split(".")
    obj = cfg
    for i in range(len(path)):
        where = ".".join(path[: i + 1])
        if where not in keys:
            break
        obj = getattr(obj, path[i])
        if obj is None:
            raise OverrideError(f"cannot set {key!r}: {where} is None in this recipe")
        if not dataclasses.is_dataclass(obj):
            raise OverrideError(f"unknown key {key!r}: {where} holds a value, not fields")
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
        raise OverrideError(f"unknown key {key!r}" + (f"; did you mean {close[0]}?" if close else ""))
    return obj, leaf


def apply(cfg, pairs: list[tuple[str, str]]) -> list[tuple[str, object, object]]:
    """Set each dotted key on `cfg` through Bridge's own override path, in order. Returns (key, old, new) for the
    plan's record."""
    from megatron.bridge.training.utils.omegaconf_utils import apply_overrides, create_omegaconf_dict_config

    if not pairs:
        return []
    keys = set(keys_of(create_omegaconf_dict_config(cfg)[0]))
    changes = []
    for key, raw in pairs:
        holder, leaf = _holder(cfg, keys, key)
        old, new = getattr(holder, leaf), convert(key, raw, holder, leaf)
        apply_overrides(cfg, reduce(lambda inner, part: {part: inner}, reversed(key.split(".")), new), {})
        changes.append((key, old, new))
    return changes


def split_intent(pairs: list[tuple[str, str]]) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """Separate `overlap.*` intent keys from config keys."""
    from overlapkit.spec.overlap import OverlapIntent

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
        intent[name] = convert_kinds(key, raw, {kind_of(default), "none"} if default is not None else {"str", "none"})
    return intent, rest
