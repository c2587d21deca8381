"""The night's JUnit XML for a night with a pass, a regression and a skip, judged from logs printed by Bridge's own
training_log() (nightly_fixtures.py) against synthetic goldens, checked against the structure junit-10.xsd (the
Jenkins xUnit plugin's schema, which pytest's junitxml follows) requires; and the summary job's exit status."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from nightly_fixtures import bridge_log, curve

from launch import commands
from overlapkit import paths
from overlapkit.cluster import slurm
from overlapkit.nightly import junit, logparse, night_report
from overlapkit.nightly import rules as regress

N = 30
LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "dp": 8, "nodes": 1, "gpus": 8, "mbs": 1, "gbs": 8, "seq": 4096}
PLAN = {"recipe": "r", "layout": LAYOUT, "overrides": [], "audit": {"rows": {}}}  # a whole plan.json: planfile reads it
SKIP = "needs 32 nodes at DP=2 (TP·PP·CP = 128 GPUs); local has 8"


def _log(step_ms: float) -> str:
    return bridge_log(curve(N), [step_ms] * N, tflops=[400.0 * 2000.0 / step_ms] * N)


def _entry(tmp_path, name: str, step_ms: float) -> dict:
    d = tmp_path / name
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({**PLAN, "recipe": name}))
    (d / "train.log").write_text(_log(step_ms))
    return {"recipe": name, "nodes": 1, "dp": 1, "run_dir": str(d), "job_id": "7", "attempt": 0}


@pytest.fixture
def night(tmp_path):
    """A night of three: `fast` matches its golden, `slow` is 20 % slower than its golden, `big` was skipped."""
    goldens = tmp_path / "goldens"
    goldens.mkdir()
    for name in ("fast", "slow"):
        golden = regress.make_golden(logparse.parse_text(_log(2000.0)), {**PLAN, "recipe": name}, {})
        (goldens / f"{name}.json").write_text(json.dumps(golden))
    entries = [_entry(tmp_path, "fast", 2000.0), _entry(tmp_path, "slow", 2400.0), {"recipe": "big", "skipped": SKIP}]
    results = [night_report.evaluate(e, "COMPLETED", [tmp_path / e["recipe"] / "train.log"], goldens, False)
               for e in entries[:2]] + [{"recipe": "big", "skipped": SKIP}]  # fmt: skip
    meta = {"stamp": "20261201-020000", "cluster": "local", "preflight_only": False, "iters": N, "checks": "full",
            "entries": entries, "job_dir": str(tmp_path / "jobs"), "goldens": str(goldens)}  # fmt: skip
    return meta, results


def test_a_pass_a_regression_and_a_skip(night):
    meta, results = night
    assert [r.get("verdict", {}).get("status") for r in results] == ["pass", "regression", None]
    root = junit.to_xml(meta, results)
    assert root.tag == "testsuites" and {"tests": "3", "failures": "1", "errors": "0"}.items() <= root.attrib.items()
    assert "skipped" not in root.attrib  # junit-10.xsd's <testsuites> has no skipped attribute
    (suite,) = root.findall("testsuite")
    assert {"name": "nightly.local", "tests": "3", "failures": "1", "errors": "0", "skipped": "1"}.items() <= (
        suite.attrib.items()
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", suite.get("timestamp")) and suite.get("hostname")
    assert re.fullmatch(r"\d+(\.\d*)?", suite.get("time"))  # junit-10.xsd's SUREFIRE_TIME
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["fast", "slow", "big"]
    assert all(c.get("classname") == "nightly.local" and c.get("time") == "0" for c in cases.values())
    assert cases["fast"].find("failure") is None and cases["fast"].find("skipped") is None
    assert cases["fast"].findtext("system-out").startswith("pass: Slurm job 7 (COMPLETED)")
    (failure,) = cases["slow"].findall("failure")
    assert failure.get("type") == "regression"
    assert failure.get("message").startswith("step_time_ms: 2400 vs golden 2000")
    assert failure.get("message") == results[1]["verdict"]["reasons"][0]  # the rule that fired
    assert cases["big"].find("skipped").get("message") == SKIP and cases["big"].find("failure") is None
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["stamp"] == "20261201-020000" and props["cluster"] == "local"


def test_write_is_a_whole_xml_file_beside_the_report(tmp_path, night):
    meta, results = night
    out = junit.write(tmp_path, meta, results)
    assert out == tmp_path / "junit.xml" and not (tmp_path / "junit.xml.tmp").exists()
    assert out.read_text().startswith("<?xml version='1.0' encoding='utf-8'?>")
    assert ET.parse(out).getroot().find("testsuite").get("failures") == "1"


def test_no_golden_and_preflight_only_pass_with_the_note():
    verdict = regress.Verdict("preflight_only", ["preflight only — no training on this machine"])
    res = {"recipe": "r", "job_id": "9", "state": "COMPLETED", "run_dir": "/x", "golden": None,
           "verdict": verdict.to_dict()}  # fmt: skip
    case = junit.to_xml({"stamp": "bad", "cluster": "c"}, [res]).find("testsuite/testcase")
    assert case.find("failure") is None and regress.NO_GOLDEN in case.findtext("system-out")


def test_the_summary_job_writes_junit_and_exits_1_when_a_recipe_regressed(tmp_path, night, monkeypatch):
    """make nightly-report's command on the night: each run's log found through its submission.json (a plain-sbatch
    job's record); Slurm's word on these made-up jobs is the one thing replaced: COMPLETED."""
    meta, _ = night
    for e in meta["entries"][:2]:
        log = tmp_path / e["recipe"] / "train.log"
        record = {"state": "submitted", "job_id": e["job_id"], "log": str(log), "run_dir": e["run_dir"]}
        (tmp_path / e["recipe"] / "submission.json").write_text(json.dumps(record))
    monkeypatch.setattr(slurm, "job_state", lambda job_id: "COMPLETED")
    night_dir = tmp_path / "jobs" / "nightly" / meta["stamp"]
    night_dir.mkdir(parents=True)
    (night_dir / "night.json").write_text(json.dumps(meta))
    assert commands.call("nightly-report", ["--night", str(night_dir), "--no-retry"]) == 1
    suite = ET.parse(night_dir / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    failure = suite.find("testcase[@name='slow']/failure")
    assert failure.get("message").startswith("step_time_ms: 2400 vs golden 2000")
    without_slow = [e for e in meta["entries"] if e["recipe"] != "slow"]
    (night_dir / "night.json").write_text(json.dumps({**meta, "entries": without_slow}))
    assert commands.call("nightly-report", ["--night", str(night_dir), "--no-retry"]) == 0


def test_a_night_of_a_relative_job_dir_keeps_its_history_where_its_nights_ran(tmp_path, night, monkeypatch):
    """The local profile's job_dir is runs/slurm: under OVERLAPKIT_RUNS its nights run in <that>/slurm/nightly, and
    the report appends their history there too, never to the checkout's runs/ (it once did: two rules of one path)."""
    meta, _ = night
    monkeypatch.setattr(slurm, "job_state", lambda job_id: "COMPLETED")
    monkeypatch.setenv("OVERLAPKIT_RUNS", str(tmp_path / "elsewhere"))
    nightly_dir = tmp_path / "elsewhere" / "slurm" / "nightly"
    (nightly_dir / meta["stamp"]).mkdir(parents=True)
    (nightly_dir / meta["stamp"] / "night.json").write_text(json.dumps({**meta, "job_dir": "runs/slurm"}))
    in_checkout = paths.REPO_ROOT / "runs" / "slurm" / "nightly" / "history.jsonl"
    before = in_checkout.read_bytes() if in_checkout.exists() else None
    assert commands.call("nightly-report", ["--night", str(nightly_dir / meta["stamp"]), "--no-retry"]) == 1
    history = night_report.read_history(nightly_dir / "history.jsonl")
    assert sorted(r["recipe"] for r in history) == ["fast", "slow"]
    assert (in_checkout.read_bytes() if in_checkout.exists() else None) == before
