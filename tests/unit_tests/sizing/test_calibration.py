"""The fit itself, on a model whose answer is known: it recovers the constants from the rows, keeps a constant no
row moves at its neutral value (what a leave-one-out fit without a constant's only row does), and stays in BOUNDS.
The fit on the real reference runs: tests/unit_tests/sizing/test_throughput.py."""

from __future__ import annotations

import dataclasses
import json
import os

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


# --- a calibration file is read and written only as a usable one (issue 43, hostile-sweep-5 area 2) -----------------

GOOD = calibration.Calibration(
    calibration.FITTED.replace(gemm_bf16=0.55),
    "c1 fitted on 3 runs on 2026-12-03",
    {"dense bf16": calibration.Band(-0.05, 0.04, 3, "3 c1 dense bf16 runs")},
    ("moe_token_s",),
)


def saved(tmp_path, **changes) -> str:
    """GOOD saved as c1, then its JSON text with `changes` (dotted keys into the file) made by hand."""
    calibration.save("c1", GOOD, [], tmp_path)
    data = json.loads((tmp_path / "c1.json").read_text())
    for key, value in changes.items():
        *where, last = key.split(".")
        node = data
        for k in where:
            node = node[k]
        node[last] = value
    return json.dumps(data)


BROKEN = {  # sweep case (and variants): the file's change, what the one line says
    "C009 a band of 1e12": ({"bands.dense bf16.high": 1e12}, "not a spread within ±50%"),
    "C021 a band low above high": ({"bands.dense bf16.low": 0.3, "bands.dense bf16.high": -0.2}, "low ≤ high"),
    "C021 a band of NaN (as text)": ({"bands.dense bf16.low": "nan"}, "bands.dense bf16.low is 'nan', not a number"),
    "a band of -100%": ({"bands.dense bf16.low": -1.0}, "not a spread within"),
    "a band of one run": ({"bands.dense bf16.runs": 1}, "not a count ≥ 2"),
    "a band not an object": ({"bands.dense bf16": 3}, "not an object"),
    "a constant of text": ({"constants.gemm_bf16": "0.5"}, "constants.gemm_bf16 is '0.5', not a number"),
    "a constant missing": ({"constants.gemm_fp8": None}, "constants.gemm_fp8 is None"),
    "a constant past its bound": ({"constants.layer_overhead_s": 1.0}, "outside its physical range"),
    "a label with a terminal escape": ({"label": "ok\u001b[2J"}, "not one line of text"),
    "another cluster's file": ({"cluster": "c2"}, "cluster 'c2''s"),
    "kept names no constant": ({"kept": ["warp_speed"]}, "not constants of the model"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_make_plan_refuses_a_calibration_that_does_not_validate_with_the_fix(tmp_path, case):
    changes, says = BROKEN[case]
    (tmp_path / "c1.json").write_text(saved(tmp_path, **changes))
    with pytest.raises(BadInput) as err:
        calibration.for_cluster("c1", tmp_path)
    msg = str(err.value)
    assert says in msg and "c1.json" in msg and calibration.FIX in msg and "\n" not in msg, msg


def test_a_nan_band_written_by_an_older_version_is_refused(tmp_path):
    """C021 as the sweep wrote it: json.dumps' NaN literal (Python writes it, JSON has none)."""
    (tmp_path / "c1.json").write_text(saved(tmp_path).replace('"low": -0.05', '"low": NaN'))
    with pytest.raises(BadInput, match=r"c1\.json: .*NaN.*make calibrate"):
        calibration.for_cluster("c1", tmp_path)


def band(**changes) -> dict:
    return {"dense bf16": dataclasses.replace(GOOD.bands["dense bf16"], **changes)}


UNUSABLE = {  # what a fit can come out as (C007/C008: pinned, absurd, NaN), refused by the reader's own rule
    "a band of +2.5e12": dataclasses.replace(GOOD, bands=band(high=2.5e12)),
    "a band of -100%": dataclasses.replace(GOOD, bands=band(low=-1.0)),
    "a NaN band": dataclasses.replace(GOOD, bands=band(low=float("nan"))),
    "a band low above high": dataclasses.replace(GOOD, bands=band(low=0.2, high=-0.1)),
    "a constant past its bound": dataclasses.replace(GOOD, constants=GOOD.constants.replace(gemm_fp8=1.2)),
    "a NaN constant": dataclasses.replace(GOOD, constants=GOOD.constants.replace(blockwise=float("nan"))),
}


@pytest.mark.parametrize("case", UNUSABLE)
def test_make_calibrate_never_writes_what_make_plan_would_refuse(tmp_path, case):
    """The writer checks by the reader's rule (calibration.problem): an unusable fit is refused, the file kept."""
    calibration.save("c1", GOOD, [], tmp_path)
    before = (tmp_path / "c1.json").read_bytes()
    with pytest.raises(BadInput, match="fit refused, .*c1.json left as it was") as err:
        calibration.save("c1", UNUSABLE[case], [], tmp_path)
    assert "\n" not in str(err.value)
    assert (tmp_path / "c1.json").read_bytes() == before and sorted(tmp_path.iterdir()) == [tmp_path / "c1.json"]


@pytest.mark.parametrize(
    "name", ["../../nightly/goldens/llama3_70b_pretrain_64gpu_h100_bf16", "../escaped", "/tmp/abs", "a/b", "x\x1b[2J"]
)
def test_a_cluster_name_that_is_a_path_never_reads_or_writes_outside_the_calibration_folder(tmp_path, name):
    """C014/C015: a profile `name` with `../` wrote over a nightly golden and was read back by make plan."""
    folder = tmp_path / "a" / "calibration"
    target = (folder / f"{name}.json").resolve()
    if target.is_relative_to(tmp_path):  # a user's own file where the name points: it must stay as it is
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"label": "precious", "constants": {}, "bands": {}}))
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(BadInput, match="cluster name=.*: (letters, digits|empty)") as err:
        calibration.save(name, GOOD, [], folder)
    assert "\n" not in str(err.value)
    with pytest.raises(BadInput, match="cluster name=.*: (letters, digits|empty)"):
        calibration.for_cluster(name, folder)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


def test_a_fifo_or_device_as_the_calibration_is_refused_at_once(tmp_path, within):
    """C018: a FIFO planted at runs/calibration/<cluster>.json hung every make plan CLUSTER=<cluster>."""
    os.mkfifo(tmp_path / "c1.json")
    (tmp_path / "c2.json").symlink_to("/dev/zero")
    with within(10), pytest.raises(BadInput, match=r"c1\.json: is not a regular file.*make calibrate"):
        calibration.for_cluster("c1", tmp_path)
    with within(10), pytest.raises(BadInput, match=r"c2\.json: is not a regular file"):
        calibration.for_cluster("c2", tmp_path)


def test_an_unwritable_calibration_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(BadInput, match="cannot be written"):
        calibration.save("c1", GOOD, [], tmp_path / "file" / "calibration")


def test_no_physical_constants_reach_a_step_outside_the_bounds_corners():
    """beyond_physics brackets the step between the fastest and the slowest constants of BOUNDS (each constant
    moves the step one way: SLOWER up, the rates down)."""
    step = toy_step
    assert step(calibration.FASTEST) < step(calibration.FITTED) < step(calibration.SLOWEST)
    assert calibration.beyond_physics(step, step(calibration.FITTED)) is None
    assert "not a step of this plan" in calibration.beyond_physics(step, step(calibration.FASTEST) * 0.4)
    assert "not a step of this plan" in calibration.beyond_physics(step, step(calibration.SLOWEST) * 1.6)
    assert "not a step of this plan" in calibration.beyond_physics(step, float("nan"))


def toy_step(k: calibration.Constants) -> float:
    """A step of GEMM time at the rates plus the per-layer and per-token times (the model's form)."""
    return 10 / k.gemm_bf16 + 5 / k.gemm_fp8 + 100 * k.layer_overhead_s + 1e6 * k.layer_token_s


def test_a_link_planted_as_the_calibration_is_never_written_through(tmp_path):
    """Issue 43: every path the project writes is resolved inside its folder first; reading a link is the guarded
    reader's business, writing through one is refused."""
    folder, outside = tmp_path / "calibration", tmp_path / "golden.json"
    folder.mkdir()
    outside.write_text('{"precious": true}')
    (folder / "c1.json").symlink_to(outside)
    with pytest.raises(BadInput, match="outside"):
        calibration.save("c1", GOOD, [], folder)
    assert outside.read_text() == '{"precious": true}'
