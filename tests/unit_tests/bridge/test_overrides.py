"""Dotted overrides on a real ConfigContainer, through Bridge's override path: typed conversion by the live field's
annotation, one-line errors naming the nearest key, and the overlap.* intent keys kept apart from config keys."""

from __future__ import annotations

import re

import pytest

from overlapkit.bridge import overrides, registry
from overlapkit.bridge.overrides import OverrideError


@pytest.fixture(scope="module")
def cfg():
    return registry.get("llama3_8b_pretrain_8gpu_h100_bf16").build()


def test_values_take_the_type_of_the_field_they_replace(cfg):
    changes = overrides.apply(cfg, overrides.parse("train.global_batch_size=256 model.sequence_parallel=true"))
    assert [(k, n) for k, _, n in changes] == [("train.global_batch_size", 256), ("model.sequence_parallel", True)]
    assert cfg.train.global_batch_size == 256 and cfg.model.sequence_parallel is True
    # An exponent without a dot, as Python and YAML 1.2 read it (YAML 1.1 would keep the string and refuse it)
    assert overrides.apply(cfg, overrides.parse("optimizer.lr=3e-4"))[0][2] == 3e-4


def test_values_are_set_by_bridges_own_override_path(cfg):
    # Bridge's apply_overrides turns a dtype's name back into the torch.dtype (a plain setattr would keep the text)
    import torch

    overrides.apply(cfg, overrides.parse("model.params_dtype=float16"))
    assert cfg.model.params_dtype is torch.float16


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("train.global_batch_size=abc", "expected an integer"),
        ("model.sequence_parallel=1", "expected true or false"),
        ("train.global_batch_siz=8", "did you mean train.global_batch_size?"),
        ("scheduler.lr_decay_style=cosin", "expected one of constant, linear, cosine"),  # the field's Literal
        ("model.foo.bar=1", "unknown key 'model.foo.bar'"),
        ("model.hidden_size.x=1", "unknown key 'model.hidden_size.x': model.hidden_size holds a value, not fields"),
        ("nothing", "is not KEY=VALUE"),
        ("optimizer.lr=.nan", "not a finite number"),  # after the import too: nan was "replaces it with nan" before
        ("train.train_iters=99999999999999999999", "beyond the 64-bit integers"),
    ],
)
def test_bad_overrides_are_one_line_errors(cfg, text, needle):
    with pytest.raises(OverrideError, match=re.escape(needle)) as exc:
        overrides.apply(cfg, overrides.parse(text))
    assert "\n" not in str(exc.value)


def test_intent_keys_are_split_from_config_keys():
    intent, rest = overrides.split_intent([("overlap.tp_preset", "default"), ("train.train_iters", "10")])
    assert intent == {"tp_preset": "default"} and rest == [("train.train_iters", "10")]
    with pytest.raises(OverrideError, match="did you mean overlap.tp_preset"):
        overrides.split_intent([("overlap.tp_presets", "x")])
