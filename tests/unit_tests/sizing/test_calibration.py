"""The fit itself, on a model whose answer is known: it recovers the constants from the rows, keeps a constant no
row moves at its neutral value (what a leave-one-out fit without a constant's only row does), and stays in BOUNDS.
The fit on the real reference runs: tests/unit_tests/sizing/test_throughput.py."""

from __future__ import annotations

import pytest

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
