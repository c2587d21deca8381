"""What each overlap is worth: real differences of the throughput model (each on overlap flipped off reproduces
`predict` with that field off), no entry for an overlap that is off, the EP overlap's worth on an MoE recipe, the
rows it names matching the overlap table's, and make plan's text and JSON carrying it (the session's plans)."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from overlapkit.bridge.build import prediction_inputs
from overlapkit.bridge.report import render_plan
from overlapkit.sizing import throughput, worth

R70 = "llama3_70b_pretrain_64gpu_h100_bf16"
QWEN = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"  # MoE, TP1 PP1 EP16: the EP overlap on, TP and PP n/a


@pytest.mark.parametrize("name", [R70, QWEN])
def test_each_on_overlap_off_is_predict_with_that_field_off(planned, name):
    plan = planned(name)
    inputs = prediction_inputs(plan)
    overlaps = inputs.overlaps
    on = {f.name for f in dataclasses.fields(overlaps) if getattr(overlaps, f.name)}
    assert set(plan.worth) == on and on  # one entry per overlap that is on, none for the others
    for field, x in plan.worth.items():
        off = inputs.predict(overlaps=dataclasses.replace(overlaps, **{field: False}))
        assert x.off_step_s == pytest.approx(off.step_s, rel=1e-12)
        assert x.step_s == pytest.approx(plan.throughput.step_s, rel=1e-12)
        assert x.delta_s == pytest.approx(off.step_s - plan.throughput.step_s)
        assert x.delta_pct == pytest.approx(100 * x.delta_s / plan.throughput.step_s)
        assert x.delta_s > 0, field  # an overlap the table says is on hides something on these layouts
    deltas = [x.delta_s for x in plan.worth.values()]
    assert deltas == sorted(deltas, reverse=True)  # the one the run depends on most, first


def test_the_70b_depends_on_tp_overlap_most_and_the_moe_on_ep(planned):
    assert set(planned(R70).worth) == {"tp", "p2p", "grad_reduce", "param_gather"}  # dense: no EP entry
    assert next(iter(planned(R70).worth)) == "tp"
    moe = planned(QWEN).worth
    assert "tp" not in moe and "p2p" not in moe  # TP1 PP1: those rows are n/a, so no worth
    assert next(iter(moe)) == "ep" and moe["ep"].delta_s > 0 and moe["ep"].delta_pct > 10


def test_an_overlap_that_is_off_has_no_worth_entry(planned):
    inputs = prediction_inputs(planned(R70))
    fewer = dataclasses.replace(inputs, overlaps=dataclasses.replace(inputs.overlaps, p2p=False, param_gather=False))
    got = worth.overlap_worth(fewer)
    assert set(got) == {"tp", "grad_reduce"}
    assert got["tp"].step_s == pytest.approx(fewer.predict().step_s)
    none_on = dataclasses.replace(inputs, overlaps=throughput.Overlaps(False, False, False, False, False))
    assert worth.overlap_worth(none_on) == {}


def test_plan_json_and_text_show_each_overlaps_worth(planned):
    plan = planned(QWEN)
    d = plan.to_dict()["throughput"]["overlap_worth"]
    assert list(d) == list(plan.worth)
    ep = d["ep"]
    assert ep["row"] == "ep_a2a_overlap" and set(ep) == {"row", "off_step_s", "delta_s", "delta_pct"}
    assert ep["off_step_s"] == pytest.approx(plan.throughput.step_s + ep["delta_s"], abs=2e-4)
    buf = io.StringIO()
    render_plan(plan, Console(file=buf, width=150, color_system=None))
    text = buf.getvalue()
    assert "What each overlap is worth" in text
    x = plan.worth["ep"]
    row = next(line for line in text.splitlines() if "│ ep_a2a_overlap " in line and "+" in line)
    assert f"{x.off_step_s:.3f}" in row and f"{x.delta_s:+.3f}" in row and f"{x.delta_pct:+.1f}%" in row
