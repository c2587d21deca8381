"""The fit itself, on a model whose answer is known: it recovers the constants from the rows, keeps a constant no
row moves at its neutral value (what a leave-one-out fit without a constant's only row does), and stays in BOUNDS.
The fit on the real reference runs: tests/unit_tests/sizing/test_throughput.py."""

from __future__ import annotations

import json

import pytest

from overlapkit.errors import BadInput
from overlapkit.sizing import calibration

TRUE = calibration.NEUTRAL.replace(gemm_fp8=0.61, layer_overhead_s=2.2e-3)


def toy(k: calibration.Constants) -> dict[str, float]:
    """Two runs that each depend on both constants differently (as a small and a large model do)."""
    return {
        "a": 1 / (1 / k.gemm_fp8 + 100 * k.layer_overhead_s),
        "b": 1 / (3 / k.gemm_fp8 + 10 * k.layer_overhead_s),
    }


def test_fit_recovers_the_constants_the_rows_were_made_with(monkeypatch):
    monkeypatch.setitem(calibration.FITTED_ON, "gemm_fp8", ("a", "b"))
    monkeypatch.setitem(calibration.FITTED_ON, "layer_overhead_s", ("a", "b"))
    for other in set(calibration.NAMES) - {"gemm_fp8", "layer_overhead_s"}:
        monkeypatch.setitem(calibration.FITTED_ON, other, ("c",))  # rows not in this fit: stay neutral
    got = calibration.fit(toy, toy(TRUE), start=calibration.NEUTRAL)
    assert got.gemm_fp8 == pytest.approx(0.61, rel=1e-5)
    assert got.layer_overhead_s == pytest.approx(2.2e-3, rel=1e-5)
    assert got.blockwise == calibration.NEUTRAL.blockwise and got.grouped_gemm == calibration.NEUTRAL.grouped_gemm


def test_fit_stays_within_bounds(monkeypatch):
    monkeypatch.setitem(calibration.FITTED_ON, "gemm_fp8", ("a", "b"))
    monkeypatch.setitem(calibration.FITTED_ON, "layer_overhead_s", ("a", "b"))
    for other in set(calibration.NAMES) - {"gemm_fp8", "layer_overhead_s"}:
        monkeypatch.setitem(calibration.FITTED_ON, other, ("c",))
    wanted = toy(TRUE.replace(gemm_fp8=5.0))  # faster than any peak allows
    got = calibration.fit(toy, wanted, start=calibration.NEUTRAL)
    assert got.gemm_fp8 == pytest.approx(calibration.BOUNDS["gemm_fp8"][1])


def test_rounded_keeps_four_significant_digits():
    k = calibration.rounded(calibration.NEUTRAL.replace(gemm_bf16=0.123456, layer_token_s=3.14159e-7))
    assert (k.gemm_bf16, k.layer_token_s) == (0.1235, 3.142e-7)


def test_a_cluster_without_a_fit_predicts_with_the_published_constants(tmp_path):
    assert calibration.for_cluster("nowhere", tmp_path) is calibration.PUBLISHED
    assert calibration.for_cluster(None) is calibration.PUBLISHED
    assert calibration.PUBLISHED.label == "published"


def test_a_saved_fit_reads_back_and_a_broken_one_is_one_line(tmp_path):
    k = calibration.FITTED.replace(gemm_bf16=0.55)
    band = calibration.Band(-0.05, 0.04, 3, "3 c1 dense bf16 runs")
    cal = calibration.Calibration(k, "c1 fitted on 3 runs on 2026-12-03", {"dense bf16": band}, ("moe_token_s",))
    calibration.save("c1", cal, [], tmp_path)
    assert calibration.for_cluster("c1", tmp_path) == cal
    (tmp_path / "c1.json").write_text('{"label": "x", "constants": {"gemm_bf16": "fast"}, "bands": {}}')
    with pytest.raises(BadInput, match=r"c1\.json: .*make calibrate") as err:
        calibration.for_cluster("c1", tmp_path)
    assert "\n" not in str(err.value)
    data = json.loads(json.dumps({"label": "x", "constants": vars(k) | {"gemm_bf16": 7.0}, "bands": {}}))
    (tmp_path / "c1.json").write_text(json.dumps(data))
    with pytest.raises(BadInput, match="gemm_bf16=7.0 is outside"):
        calibration.for_cluster("c1", tmp_path)


def test_a_class_without_published_runs_takes_its_family_band_and_says_so():
    moe_bf16 = calibration.PUBLISHED.band(True, "bf16")
    assert moe_bf16.low <= calibration.BANDS["MoE fp8"].low and moe_bf16.high >= calibration.BANDS["MoE fp8"].high
    assert moe_bf16.of.startswith("no MoE bf16 run")
    assert calibration.PUBLISHED.band(False, "fp8") == calibration.BANDS["dense fp8"]
