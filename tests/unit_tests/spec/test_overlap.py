"""The overlap table: each row's throughput term is a field the model reads, its class one the report measures, and
a recipe may keep off only the rows that say why."""

from __future__ import annotations

import dataclasses

import pytest

from overlapkit.errors import BadInput
from overlapkit.profile import overlap_claims, overlap_classes
from overlapkit.sizing import throughput
from overlapkit.spec.overlap import KEEP_OFF, Overlap, OverlapIntent


def test_each_term_switches_the_one_overlaps_field_it_names():
    terms = [o.term for o in Overlap if o.term]
    assert terms == [f.name for f in dataclasses.fields(throughput.Overlaps)]
    for o in Overlap:
        flipped = throughput.Overlaps.of_rows({o: "on"})
        assert [f.name for f in dataclasses.fields(flipped) if getattr(flipped, f.name)] == [o.term] * bool(o.term)


def test_each_class_is_one_the_report_measures_and_claims():
    assert {o.klass for o in Overlap} - {None} <= set(overlap_classes.CLASSES)
    for o in Overlap:
        if o.klass:
            lay = overlap_classes.Layout(tp=2, pp=2, cp=2, dp=2, ep=2, gpus=32, dispatcher="", states={o: "on"})
            assert overlap_claims.claim(o.klass, lay) == "on", o


def test_labels_and_fields_are_one_per_row():
    assert len({o.label for o in Overlap}) == len({o.field for o in Overlap}) == len(Overlap)
    assert Overlap("ep_a2a_overlap") is Overlap.EP and f"{Overlap.EP}" == "ep_a2a_overlap"


def test_a_recipe_keeps_off_only_what_the_table_allows_with_its_reason():
    assert KEEP_OFF == {Overlap.TP, Overlap.P2P, Overlap.RS, Overlap.EP}
    intent = OverlapIntent(off=((Overlap.TP, "no preset"),))
    assert intent.why_off("tp_comm_overlap") == "no preset" and intent.why_off(Overlap.EP) is None
    with pytest.raises(BadInput, match="may not keep overlap_param_gather off"):
        OverlapIntent(off=((Overlap.AG, "why"),))
