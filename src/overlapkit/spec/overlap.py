"""The overlaps: one row per overlapped communication a plan claims, and what each reader needs of it.

Each member is its overlap-table row's name (a str: the audit's rows and plan.json's keys), with the config field
that switches it, `make recipes`' label and legend, why a recipe may keep it off (None: it may not), the throughput
term it switches (sizing/throughput.py's Overlaps field; None: not modelled) and the profile class whose exposure
tests the claim (profile/overlap_claims.py; None: none of its own). CP has no row: Transformer Engine's
context-parallel attention always overlaps its ring. OverlapIntent is the recipe's claim about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from overlapkit.errors import BadInput

ON, OFF, NA = "on", "off", "n/a"  # a row's states


class Overlap(StrEnum):
    # row, config field, label, what it overlaps, why a recipe may keep it off, throughput term, profile class
    TP = (
        "tp_comm_overlap",
        "comm_overlap.tp_comm_overlap",
        "TP",
        "tensor-parallel userbuffers",
        "NVIDIA runs some TP layouts without userbuffers, overlapping other traffic (or with no Bridge preset)",
        "tp",
        "tp",
    )
    P2P = (
        "overlap_p2p_comm",
        "comm_overlap.overlap_p2p_comm",
        "P2P",
        "pipeline p2p",
        "only the interleaved schedule overlaps p2p: a measured layout without a virtual pipeline has none",
        "p2p",
        "pp",
    )
    RS = (
        "overlap_grad_reduce",
        "comm_overlap.overlap_grad_reduce",
        "RS",
        "data-parallel grad reduce-scatter",
        "with many microbatches per step, the one reduce-scatter after the last is a small share of it",
        "grad_reduce",
        "dp",
    )
    AG = (
        "overlap_param_gather",
        "comm_overlap.overlap_param_gather",
        "AG",
        "param all-gather",
        None,
        "param_gather",
        "dp",
    )
    FP8_AG = (
        "fp8_param_gather",
        "mixed_precision.fp8_param_gather",
        "FP8-AG",
        "FP8 param all-gather",
        None,
        None,
        None,
    )
    EP = (
        "ep_a2a_overlap",
        "comm_overlap.overlap_moe_expert_parallel_comm",
        "EP",
        "expert-parallel all-to-all",
        "NVIDIA measures some MoE layouts without the 1F1B all-to-all overlap",
        "ep",
        "ep",
    )

    def __new__(cls, row: str, field: str, label: str, what: str, keep_off: str | None, term: str | None, klass):
        member = str.__new__(cls, row)
        member._value_ = row
        member.field, member.label, member.what, member.keep_off = field, label, what, keep_off
        member.term, member.klass = term, klass
        return member


KEEP_OFF = {o for o in Overlap if o.keep_off}  # what OverlapIntent.off may name


@dataclass
class OverlapIntent:
    """What the recipe claims, beyond what ConfigContainer can say (a field of the registry's Recipe)."""

    tp_preset: str | None = None  # exported preset name, bridge/presets.DEFAULT_TP_CONFIG (opt-in), or None = auto
    param_gather_with_optimizer_step: bool = False  # opt-in: Bridge leaves it off because of checkpointing
    # MoE: delay the expert weight-gradient GEMMs so they overlap the EP all-to-all (needs EP a2a overlap).
    delay_wgrad: bool = False
    # Overlaps the recipe keeps off on purpose, as NVIDIA's measured recipe does: ((Overlap, why), ...), of those
    # whose keep_off says a recipe may. The audit shows them "off" with that reason; anything else missing is an error.
    off: tuple[tuple[Overlap, str], ...] = ()

    def __post_init__(self):
        if bad := [str(o) for o, _ in self.off if str(o) not in KEEP_OFF]:
            raise BadInput(f"a recipe may not keep {', '.join(bad)} off: drop it from OverlapIntent.off")

    def why_off(self, name: str) -> str | None:
        return dict(self.off).get(name)
