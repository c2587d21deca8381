"""The data spec (`DATA=<data.toml>`, written by `make prep-data`; docs/pretraining.md shows one): its typed model,
the shape of the file checked before any of the files it names is opened (bridge/data.py checks those, and applies
the spec with Bridge's own GPTDatasetConfig and TokenizerConfig). Every problem is one line naming the fix.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BaseModel, Field, PlainValidator, ValidationInfo, model_validator

from overlapkit.spec.model import STRICT

SPLITS = ("train", "valid", "test")
KEYS = ("tokenizer", "split", "cache", "blend", "blend_per_split")
_SHARE = re.compile(r"\s*\d+(\.\d*)?\s*", re.ASCII)  # a non-negative number in ASCII digits ('9²' is not one)


def _weight(w, info: ValidationInfo) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
        raise ValueError(f"weight {w!r} of {info.data.get('prefix')}: weights must be positive numbers below infinity")
    return float(w)


class Entry(BaseModel):
    """One dataset of a blend: `<prefix>.bin` and `<prefix>.idx`, and its share."""

    model_config = STRICT
    prefix: str
    weight: Annotated[float, PlainValidator(_weight)] = 1.0


Blend = Annotated[list[Entry], Field(min_length=1)]


class PerSplit(BaseModel):
    model_config = STRICT
    train: Blend
    valid: Blend | None = None
    test: Blend | None = None


class DataToml(BaseModel):
    model_config = STRICT
    tokenizer: str
    cache: str = "index-cache"
    split: object = None  # read as text, as Megatron's split string is
    blend: Blend | None = None
    blend_per_split: PerSplit | None = None

    @model_validator(mode="after")
    def _one_blend(self):
        """Exactly one kind of blend; one blend's split is train,valid,test shares: three non-negative numbers, the
        train share above 0 (a run with no training data would read nothing; Megatron would build its train split
        empty)."""
        if (self.blend is None) == (self.blend_per_split is None):
            raise ValueError("set exactly one of [[blend]] (with split) and [blend_per_split] (train/valid/test)")
        if self.blend is None:
            if self.split is not None:
                raise ValueError(
                    "split applies to [[blend]] only; [blend_per_split] names each split's prefixes itself"
                )
            return self
        self.split = split = str("98,1,1" if self.split is None else self.split)
        parts = split.split(",")
        if len(parts) != 3 or not all(_SHARE.fullmatch(p) for p in parts):
            raise ValueError(f'split = {split!r}: three non-negative numbers (train,valid,test), e.g. "98,1,1"')
        if not float(parts[0]) > 0:
            raise ValueError(f'split = {split!r}: the train share is 0, so the run has no training data; e.g. "98,1,1"')
        return self


_LIST = 'a blend is a list of tables: [[blend]] prefix = "..." weight = 1.0'
_ENTRY = 'blend entry {value!r}: use prefix = "<path without .bin/.idx>" and weight = <number>'
_TABLE = "[blend_per_split] takes train (required), valid and test, each a list of {{prefix, weight}}"
MESSAGES = {
    ":extra_forbidden": "unknown key {key!r}; valid: " + ", ".join(KEYS),
    "tokenizer": 'tokenizer = "<local Hugging Face tokenizer directory>" is required',
    "cache": 'cache = {value!r}: a directory path, e.g. cache = "index-cache"',
    "blend_per_split": _TABLE,
    "blend_per_split.train:missing": _TABLE,
    **{place: _LIST for place in ("blend", *(f"blend_per_split.{s}" for s in SPLITS))},
    **{f"{place}.*": _ENTRY for place in ("blend", *(f"blend_per_split.{s}" for s in SPLITS))},
}
