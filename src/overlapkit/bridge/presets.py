"""Userbuffers (TP comm-overlap) presets: discovered from what Bridge exports, never retyped here.

Bridge names its presets `userbuffers_<dtype>_<gpu>_h<hidden>_tp<tp>[_cp<cp>]_mbs<mbs>_seqlen<seq>[_lora]`
(megatron/bridge/training/comm_overlap.py). We parse the name into a PresetKey and match it against the model's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from functools import cache

from overlapkit.errors import BadInput
from overlapkit.sizing.hardware import HARDWARE
from overlapkit.spec.shape import ModelShape
from overlapkit.spec.topology import DEFAULT_GPU

_NAME = re.compile(
    r"^userbuffers_(?P<dtype>bf16|fp8)_(?P<gpu>[a-z0-9]+)_h(?P<hidden>\d+)_tp(?P<tp>\d+)"
    r"(?:_cp(?P<cp>\d+))?_mbs(?P<mbs>\d+)_seqlen(?P<seq>\d+)(?P<lora>_lora)?$"
)
# A mismatch in these fields means another GPU, GEMM shape, TP group or overlap method (FP8 presets use ring
# exchange where BF16 ones pipeline): an error.
HARD_FIELDS = ("gpu", "dtype", "hidden", "tp")
# Userbuffers are sized from the run's real (seq·mbs/cp, hidden) at TE init (Megatron's initialize_ub), so these
# only change how well the tuned SM counts/splits fit: a warning. A name without `_cp` is not CP-specific:
# NVIDIA's own 70B H100 BF16 perf recipe runs CP=2 with userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192.
SOFT_FIELDS = ("cp", "mbs", "seq")
DEFAULT_TP_CONFIG = "default"  # explicit opt-in to TE's built-in userbuffers config (tp_comm_overlap_cfg=None)


@dataclass(frozen=True)
class PresetKey:
    """What a userbuffers preset is tuned for (the fields of its name)."""

    gpu: str
    dtype: str
    hidden: int
    tp: int
    cp: int | None  # None in a preset name: not CP-specific
    mbs: int
    seq: int

    @classmethod
    def of(cls, shape: ModelShape, *, tp: int, cp: int, mbs: int, gpu: str = DEFAULT_GPU) -> PresetKey:
        """The key a model needs at this TP/CP/MBS on `gpu` (an H200 runs the H100 presets: sizing/hardware.py)."""
        return cls(HARDWARE[gpu].presets, shape.dtype, shape.hidden, tp, cp, mbs, shape.seq)


def key_of(cfg, gpu: str = DEFAULT_GPU) -> PresetKey:
    m = cfg.model
    return PresetKey.of(
        ModelShape.of(cfg),
        tp=m.tensor_model_parallel_size,
        cp=m.context_parallel_size or 1,
        mbs=cfg.train.micro_batch_size,
        gpu=gpu,
    )


@dataclass(frozen=True)
class Preset:
    name: str
    key: PresetKey
    lora: bool


class PresetError(BadInput):
    """One-line, user-facing."""


@cache
def exported_presets() -> dict[str, Preset]:
    """Every `userbuffers_*` TransformerLayerTPOverlapCfg that Bridge's comm_overlap module exports."""
    from megatron.bridge.training import comm_overlap as co

    out = {}
    for name, value in vars(co).items():
        m = _NAME.match(name)
        if m and isinstance(value, co.TransformerLayerTPOverlapCfg):  # the name's groups are PresetKey's fields
            g = {k: int(v) if v and v.isdigit() else v for k, v in m.groupdict().items()}
            lora = bool(g.pop("lora"))
            out[name] = Preset(name, PresetKey(**g), lora)
    return out


def preset_object(name: str):
    from megatron.bridge.training import comm_overlap as co

    if name not in exported_presets():
        raise PresetError(f"unknown userbuffers preset {name!r}; known: {', '.join(sorted(exported_presets()))}")
    return getattr(co, name)


def name_of(obj) -> str | None:
    """The exported name of a preset object (identity, then equality), or None for a custom/None config."""
    same = next((name for name in exported_presets() if preset_object(name) is obj), None)
    return same or next((name for name in exported_presets() if preset_object(name) == obj), None)


def mismatches(preset: Preset, key: PresetKey) -> tuple[list[str], list[str]]:
    """(hard, soft) field mismatches as 'field preset→model' strings."""
    p, s = asdict(preset.key), asdict(key)
    hard = [f"{f} {p[f]}≠{s[f]}" for f in HARD_FIELDS if p[f] != s[f]]
    soft = [f"{f} {p[f]}≠{s[f]}" for f in SOFT_FIELDS if p[f] is not None and p[f] != s[f]]
    return hard, soft


def nearest(key: PresetKey, k: int = 3) -> list[str]:
    """Pretraining presets ranked by how many key fields differ (hard fields weigh more)."""
    pretraining = (p for p in exported_presets().values() if not p.lora)
    ranked = sorted(pretraining, key=lambda p: (*map(len, mismatches(p, key)), p.name))  # (hard, soft, name)
    return [p.name for p in ranked[:k]]


def select(key: PresetKey) -> str:
    """The exported pretraining preset matching `key` (a CP-specific one first), else a one-line PresetError."""
    if fits := [p for p in exported_presets().values() if not p.lora and mismatches(p, key) == ([], [])]:
        return sorted(fits, key=lambda p: (p.key.cp is None, p.name))[0].name
    raise PresetError(
        f"no Bridge userbuffers preset for {key.gpu} {key.dtype} h{key.hidden} tp{key.tp} cp{key.cp} "
        f"mbs{key.mbs} seq{key.seq}; nearest: {', '.join(nearest(key))}; "
        f"to use TE's default userbuffers config instead, opt in with tp_preset={DEFAULT_TP_CONFIG!r}"
    )
