"""Dotted overrides (`SET="train.global_batch_size=512 model.sequence_parallel=false"`) on a real ConfigContainer.

Values are parsed as YAML scalars and converted to the type of the field they replace; anything unknown or
ill-typed is a one-line OverrideError naming the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import json
import math
import re
import shlex
from functools import cache
from pathlib import Path

import yaml

from overlapkit import jsonio
from overlapkit.bridge import stack
from overlapkit.errors import BadInput
from overlapkit.spec import runopts

INTENT_PREFIX = "overlap."  # keys that change the overlap intent, not a config field (see OverlapIntent)
# The recorded schema: every `section.field` of the shipped recipes' ConfigContainers with the kinds its annotation
# allows (written by `python -m overlapkit.bridge.inputs --record`; trusted only for the Bridge it was recorded from).
SCHEMA_FILE = Path(__file__).with_name("config_schema.json")
SCHEMA_PACKAGES = ("megatron-bridge", "megatron-core")


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


def fields_of(obj) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return [k for k in vars(obj) if not k.startswith("_")] if hasattr(obj, "__dict__") else []


def valid_keys(root, prefix: str = "", depth: int = 2) -> list[str]:
    out = []
    for name in fields_of(root):
        key = f"{prefix}{name}"
        out.append(key)
        child = getattr(root, name, None)
        if depth > 1 and dataclasses.is_dataclass(child):
            out += valid_keys(child, key + ".", depth - 1)
    return out


def _nearest(key: str, root) -> str:
    close = difflib.get_close_matches(key, valid_keys(root), n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


_READABLE = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "list": "a list, e.g. [a, b]",
    "dict": "a mapping, e.g. {a: 1}",
    "none": "null",
}


def kind_of(value) -> str:
    """The schema's name for the kind of `value`."""
    if value is None:
        return "none"
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t.__name__
    return "list" if isinstance(value, (list, tuple)) else "dict" if isinstance(value, dict) else "object"


def kinds_of(current) -> set[str]:
    """What an unrecorded field accepts, judged from its current value: its kind (or null); anything when None."""
    return {"any"} if current is None else {kind_of(current), "none"}


def to_raw(value) -> str:
    """A value as SET text (the inverse of convert for scalars): null, true/false, or str()."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@cache
def schema() -> dict[str, dict]:
    """{section.field: {"kinds": [...], "choices"?: [...]}}, or {} when the installed stack is not the recorded one."""
    if not SCHEMA_FILE.is_file():
        return {}
    data = json.loads(SCHEMA_FILE.read_text())
    return data["keys"] if data.get("versions") == stack.versions(SCHEMA_PACKAGES) else {}


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, each decimal integer it reads (a scalar, or one inside a list or dict) bounded on its digits
    first (jsonio.integer): 5,000 digits would reach Python's digit limit inside PyYAML's own int()."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node).replace("_", "").lstrip("+-")
        if not text.startswith(("0b", "0x")):  # int(text, 2 or 16) has no digit limit; number_problem bounds it
            for part in text.split(":"):  # YAML 1.1's base 60 (1:30 is 90): each part a decimal int()
                if jsonio.integer(part) is None:
                    shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"{shown} is beyond the 64-bit integers Megatron stores (at most {runopts.INT64_MAX:,})",
                        node.start_mark,
                    )
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def convert_kinds(key: str, raw: str, kinds: set[str], choices=None):
    """`raw` (YAML scalar text) as a value of one of `kinds` (the recorded schema's, or kinds_of(current))."""
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
    if value is None:
        return None if "none" in kinds else _REFUSED
    if isinstance(value, bool):
        return value if "bool" in kinds else _REFUSED
    if isinstance(value, int) and "float" in kinds and "int" not in kinds:
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float: number_problem names it
            return math.inf
    if isinstance(value, int):
        return value if "int" in kinds else _REFUSED
    if isinstance(value, float):
        return value if "float" in kinds else _REFUSED
    if isinstance(value, str):
        return value if "str" in kinds else _REFUSED
    if isinstance(value, (list, tuple)):
        return value if "list" in kinds else _REFUSED
    return value if isinstance(value, dict) and "dict" in kinds else _REFUSED


def convert(key: str, raw: str, current=None):
    """`raw` converted to the type of the field it replaces: the recorded schema's kinds, else `current`'s."""
    entry = schema().get(key)
    if entry is None:
        return convert_kinds(key, raw, kinds_of(current))
    return convert_kinds(key, raw, set(entry["kinds"]), entry.get("choices"))


def apply(cfg, pairs: list[tuple[str, str]]) -> list[tuple[str, object, object]]:
    """Set each dotted key on `cfg`. Returns (key, old, new) for the plan's record."""
    changes = []
    for key, raw in pairs:
        *path, leaf = key.split(".")
        obj = cfg
        for i, part in enumerate(path):
            if part not in fields_of(obj):
                raise OverrideError(f"unknown key {key!r}: no {'.'.join(path[: i + 1])!r}{_nearest(key, cfg)}")
            obj = getattr(obj, part)
            if obj is None:
                raise OverrideError(f"cannot set {key!r}: {'.'.join(path[: i + 1])} is None in this recipe")
        if leaf not in fields_of(obj):
            raise OverrideError(f"unknown key {key!r}{_nearest(key, cfg)}")
        old = getattr(obj, leaf)
        new = convert(key, raw, old)
        setattr(obj, leaf, new)
        changes.append((key, old, new))
    return changes


def split_intent(pairs: list[tuple[str, str]]) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """Separate `overlap.*` intent keys from config keys."""
    from overlapkit.bridge.overlap import OverlapIntent

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
        intent[name] = convert_kinds(key, raw, kinds_of(default) if default is not None else {"str", "none"})
    return intent, rest
