"""The nightly's profiled steps and its exposed-communication rule (issue #24): the NSYS window each night gets, the
profiled iterations left out of the step-time comparison, rule 6 against the golden's exposed shares, the report's
column and timeline link, and bless recording the shares. Logs come from Bridge's own training_log
(nightly_fixtures.py); overlap_report.json is the overlap report's JSON shape, its numbers synthetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nightly_fixtures import bridge_log, curve

from overlapkit.nightly import exposed, logparse, night_report, nightly
from overlapkit.nightly import rules as regress
from overlapkit.spec import runopts

N = 60
WINDOW = exposed.profile_window(N)
PLAN = {
    "recipe": "llama3_70b_pretrain_64gpu_h100_bf16",
    "layout": {"tp": 4, "pp": 4, "cp": 2, "dp": 2, "nodes": 8, "gpus": 64, "mbs": 1, "gbs": 256, "seq": 8192},
    "overrides": [],
    "audit": {"rows": {"tp_comm_overlap": {"state": "on"}}},
    "run": {"nsys": {"steps": list(WINDOW), "ranks": [0, 8, 16, 24, 32, 40, 48, 56]}},
}
SLOW = 6000.0  # what the profiled iterations log: the capture's overhead


def _log(step=2000.0) -> str:
    """60 iterations at `step` ms after 3 slow ones, and the iterations the NSYS window perturbs three times slower."""
    times = [4000.0] * 3 + [step] * (N - 3)
    for it in runopts.perturbed_iterations(WINDOW):
        times[it - 1] = SLOW
    return bridge_log(curve(N), times, tflops=[400.0 * 2000.0 / t for t in times])


def _overlap(**shares) -> dict:
    classes = {
        k: {"comm_ms": 10.0, "exposed_ms": 10.0 * v, "exposed_share": v, "kernels": 4} for k, v in shares.items()
    }
    return {"classes": classes, "ranks": {}, "findings": []}


def _run_dir(tmp_path, name, overlap=None, png=False, plan=PLAN, step=2000.0):
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps(plan))
    (d / "train.log").write_text(_log(step))
    (d / "nightly.json").write_text(json.dumps({"preflight_only": False}))
    if overlap is not None:
        (d / runopts.OVERLAP_JSON).write_text(json.dumps(overlap))
    if png:
        (d / runopts.OVERLAP_PNG).write_bytes(b"\x89PNG\r\n\x1a\n")
    return d


def _bless(d, goldens):
    parsed = logparse.parse_files([d / "train.log"], exclude=logparse.profiled_iterations(PLAN))
    return json.loads(regress.bless(d, parsed, goldens, state="COMPLETED", submission={"job_id": "7"}).read_text())


def test_every_night_profiles_two_steady_steps_of_one_rank_per_node():
    shape = nightly.shape_for("r", {"tp": 4, "pp": 4, "cp": 2, "mbs": 1, "gbs": 256, "nodes": 8})
    assert (shape.profiler, shape.window, shape.ranks) == ("nsys", "33:35", "0,8,16,24,32,40,48,56")
    perturbed = runopts.perturbed_iterations(WINDOW)
    assert list(perturbed) == [34, 35, 36]  # two captured, and the one whose timer holds cudaProfilerStop
    assert min(perturbed) > logparse.WARMUP_ITERS and max(perturbed) < N  # steady, and not the last iteration
    assert nightly.run_options(shape.to_dict()) == runopts.RunOptions(
        nsys=(33, 35), nsys_ranks=(0, 8, 16, 24, 32, 40, 48, 56)
    )
    assert nightly.profile_window(14) == (10, 12) and nightly.profile_window(13) is None  # 4 steady: 2 + 1 + 1 left
    short = nightly.shape_for("r", {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "gbs": 8, "nodes": 1}, iters=5)
    assert (short.window, short.ranks) == ("", "") and nightly.run_options(short.to_dict()).nsys is None


def test_a_night_on_a_cluster_without_nsys_profiles_the_same_iterations_with_the_pytorch_profiler():
    """profiler = "torch" in the cluster profile: TORCH_PROFILE=34:36 captures iterations 34 and 35 as NSYS=33:35 does
    (the PyTorch profiler records start..end-1, nsys start+1..end); its warm-up (33) and export (36) iterations are
    left out of the step-time mean."""
    layout = {"tp": 4, "pp": 4, "cp": 2, "mbs": 1, "gbs": 256, "nodes": 8}
    shape = nightly.shape_for("r", layout, profiler="torch_profile")
    assert (shape.window, shape.ranks) == ("34:36", "0,8,16,24,32,40,48,56")
    assert shape.typed == "TORCH_PROFILE=34:36 TORCH_PROFILE_RANKS=0,8,16,24,32,40,48,56"
    assert shape.sets == nightly.shape_for("r", layout).sets  # the same run otherwise
    entry = json.loads(json.dumps(shape.to_dict()))  # as night.json holds it, and a retry reads it back
    assert entry["torch_profile"] == "34:36" and "nsys" not in entry
    assert nightly.run_options(entry) == runopts.RunOptions(
        torch_profile=(34, 36), torch_profile_ranks=(0, 8, 16, 24, 32, 40, 48, 56)
    )
    plan = {**PLAN, "run": {"torch_profile": {"steps": [34, 36], "ranks": [0]}}}
    assert list(logparse.profiled_iterations(plan)) == [33, 34, 35, 36]  # warm-up, ProfilerStep#34 and #35, export
    short = nightly.shape_for(
        "r", {**layout, "nodes": 1, "tp": 1, "pp": 1, "cp": 1, "gbs": 8}, iters=5, profiler="torch_profile"
    )
    assert (short.window, short.ranks) == ("", "") and nightly.run_options(short.to_dict()).torch_profile is None


def test_the_profiled_iterations_are_left_out_of_the_step_time_comparison(tmp_path):
    kept = logparse.parse_text(_log(), exclude=logparse.profiled_iterations(PLAN))["summary"]
    assert kept["step_time_ms"] == 2000.0 and kept["tflops_per_gpu"] == 400.0
    assert kept["excluded_iterations"] == [34, 35, 36] and kept["steady_iterations"] == N - 10 - 3
    assert logparse.parse_text(_log())["summary"]["step_time_ms"] > 2100  # without it: a false +12 % regression
    golden = regress.make_golden(logparse.parse_text(_log(), exclude=[34, 35, 36]), PLAN, {})
    d = _run_dir(tmp_path, "run", _overlap(tp=0.02))
    entry = {"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": "1"}
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / f"{PLAN['recipe']}.json").write_text(json.dumps(golden))
    res = night_report.evaluate(entry, "COMPLETED", [d / "train.log"], tmp_path / "g", preflight_only=False)
    assert res["summary"]["step_time_ms"] == 2000.0 and res["verdict"]["status"] == "pass"


@pytest.fixture(scope="module")
def golden():
    g = regress.make_golden(logparse.parse_text(_log(), exclude=[34, 35, 36]), PLAN, {}, _overlap(tp=0.05, dp=0.20))
    assert g["exposed_share"] == {"tp": 0.05, "dp": 0.20}
    return g


def _verdict(golden, report, missing=None):
    parsed = logparse.parse_text(_log(), exclude=[34, 35, 36])
    return regress.classify(parsed, "COMPLETED", golden, overlap=(report, missing))


def test_an_exposed_share_rising_beyond_the_margin_is_a_regression_with_its_reason(golden):
    v = _verdict(golden, _overlap(tp=0.40, dp=0.21))
    assert v.status == "regression" and exposed.EXPOSED_MARGIN == 0.05
    assert v.reasons == [
        "tp communication exposed 40.0% vs golden 5.0% (+35.0 points, margin ±5): an overlap stopped hiding it"
    ]


def test_within_the_margin_passes_and_beyond_it_downward_is_an_unexpected_improvement(golden):
    assert _verdict(golden, _overlap(tp=0.099, dp=0.151)).status == "pass"  # +4.9 and -4.9 points
    v = _verdict(golden, _overlap(tp=0.05, dp=0.02))
    assert v.status == "unexpected_improvement" and v.reasons[0].startswith("dp communication exposed 2.0%")


def test_a_missing_report_or_class_is_stated_and_a_new_exposed_class_counts(golden):
    v = _verdict(golden, None, "no overlap_report.json in the run directory")
    assert v.status == "regression" and v.reasons == [
        "exposed communication: no overlap_report.json in the run directory, but the golden has exposed shares for "
        "tp, dp: the night cannot show its overlaps hide them"
    ]
    v = _verdict(golden, _overlap(dp=0.2))
    assert v.status == "regression" and v.reasons == [
        "tp communication: none in the profile (golden exposed share 5.0%)"
    ]
    v = _verdict(golden, _overlap(tp=0.05, dp=0.2, ep=0.3))  # a class the blessed run did not have: golden 0
    assert v.status == "regression" and v.reasons[0].startswith("ep communication exposed 30.0% vs golden 0.0%")
    assert (
        _verdict({**golden, "exposed_share": None}, None, "no overlap_report.json").status == "pass"
    )  # an older golden


def test_the_report_has_an_exposed_column_per_class_and_links_each_runs_timeline(tmp_path, golden):
    gdir = tmp_path / "goldens"
    gdir.mkdir()
    (gdir / f"{PLAN['recipe']}.json").write_text(json.dumps(golden))
    entries = []
    for name, overlap in (("hidden", _overlap(tp=0.06, dp=0.2)), ("lost", _overlap(tp=0.6, dp=0.2)), ("none", None)):
        d = _run_dir(tmp_path, name, overlap, png=overlap is not None)
        if name == "none":
            (d / "nsys").mkdir()
            (d / "nsys" / "rank0.sqlite").write_bytes(b"")
        entries.append({"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": name})
    results = [night_report.evaluate(e, "COMPLETED", [Path(e["run_dir"]) / "train.log"], gdir, False) for e in entries]
    night = {"stamp": "20261202-020000", "cluster": "test", "preflight_only": False}
    report = night_report.write_report(tmp_path / "nightly" / "n", night, results, tmp_path / "h.jsonl").read_text()
    rows = [line for line in report.splitlines() if line.startswith(f"| {PLAN['recipe']}")]
    assert "| exposed comm per class (vs golden) |" in report and "margin ±5 points" in report
    assert "| tp 6.0% (+1.0 pts), dp 20.0% (+0.0 pts); [timeline](../../runs/hidden/overlap_timeline.png) |" in rows[0]
    assert "**regression**" in rows[1] and "tp communication exposed 60.0% vs golden 5.0%" in rows[1]
    assert (
        "— (no overlap_report.json in the run directory but nsys/ has 1 SQLite export(s): make overlap-report RUN="
        in rows[2]
    )
    assert "exposed communication: no overlap_report.json in the run directory" in rows[2]
    history = (tmp_path / "h.jsonl").read_text().splitlines()  # one record per run (read_history keeps a recipe's last)
    assert [json.loads(line)["exposed_share"] for line in history] == [
        {"tp": 0.06, "dp": 0.2},
        {"tp": 0.6, "dp": 0.2},
        None,
    ]


def test_a_preflight_night_and_an_unprofiled_run_say_why_there_is_no_column(tmp_path):
    pre = night_report.exposed_of(_run_dir(tmp_path, "pre"), PLAN, preflight_only=True)
    assert pre["shares"] is None and pre["missing"] == "preflight only: no training, so no profile"
    bare = night_report.exposed_of(_run_dir(tmp_path, "bare"), {**PLAN, "run": {}}, preflight_only=False)
    assert bare["missing"] == "not profiled: plan.json has no NSYS or TORCH_PROFILE window"
    lost = night_report.exposed_of(_run_dir(tmp_path, "lost"), PLAN, False)["missing"]
    assert lost.endswith("and no SQLite export in nsys/: the job log says why the profile was not kept")


def test_bless_records_the_exposed_shares_and_refuses_a_profiled_run_without_them(tmp_path):
    g = _bless(_run_dir(tmp_path, "ok", _overlap(tp=0.04, pp=0.3, dp=0.1)), tmp_path / "goldens")
    assert g["exposed_share"] == {"tp": 0.04, "pp": 0.3, "dp": 0.1} and g["excluded_iterations"] == [34, 35, 36]
    assert g["step_time_ms"] == 2000.0  # the golden's step time leaves the profiled iterations out too
    bad = _run_dir(tmp_path, "bad")
    with pytest.raises(regress.BlessError) as err:
        _bless(bad, tmp_path / "goldens")
    msg = str(err.value)
    assert "\n" not in msg and "the run was profiled (NSYS=33:35) but its exposed shares cannot be read (no " in msg
    assert f"(make overlap-report RUN={bad} writes {bad / 'overlap_report.json'}), then bless" in msg
    (bad / runopts.OVERLAP_JSON).write_text("[]")
    with pytest.raises(regress.BlessError, match="overlap_report.json is not the overlap report's JSON"):
        _bless(bad, tmp_path / "goldens")
