"""The nightly's orchestration decisions on real parsed logs: which runs are resubmitted (`to_retry`), and the
night's evaluation of skipped and judged entries. Submission itself runs on the local Slurm (tests/e2e)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nightly_fixtures import bridge_log, curve

from launch.nightly import REPORT_COMMAND
from overlapkit.bridge import submission
from overlapkit.nightly import night_report, nightly

N = 30
LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "dp": 8, "nodes": 1, "gpus": 8, "mbs": 1, "gbs": 8, "seq": 4096}
PLAN = {"recipe": "r", "layout": LAYOUT, "overrides": [], "audit": {"rows": {}}}  # a whole plan.json: planfile reads it


def _entry(tmp_path, name: str, *, nan_at=None, attempt=0) -> dict:
    losses = curve(N)
    if nan_at:
        losses[nan_at - 1] = float("nan")
    d = tmp_path / name
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({**PLAN, "recipe": name}))
    (d / "train.log").write_text(bridge_log(losses, [2000.0] * N, tflops=[400.0] * N))
    return {"recipe": name, "nodes": 1, "dp": 1, "run_dir": str(d), "job_id": "1", "attempt": attempt}


def _judge(tmp_path, entry: dict, state: str) -> dict:
    log = [Path(entry["run_dir"]) / "train.log"]
    return night_report.evaluate(entry, state, log, tmp_path / "goldens", preflight_only=False)


@pytest.mark.parametrize(
    ("state", "nan_at", "attempt", "retried"),
    [
        ("NODE_FAIL", None, 0, True),  # infrastructure: one retry
        ("PREEMPTED", None, 0, True),
        ("NODE_FAIL", None, 1, False),  # ... and only one
        ("NODE_FAIL", 5, 0, False),  # NaN loss decides, even on a failed node: never retried
        ("FAILED", 5, 0, False),
        ("COMPLETED", None, 0, False),
    ],
)
def test_to_retry_resubmits_infrastructure_failures_once_and_never_a_nan(tmp_path, state, nan_at, attempt, retried):
    e = _entry(tmp_path, "a", nan_at=nan_at, attempt=attempt)
    night = {"entries": [e, {"recipe": "b", "skipped": "needs 64 nodes"}]}
    results = [_judge(tmp_path, e, state), {"recipe": "b", "skipped": "needs 64 nodes"}]
    assert nightly.to_retry(night, results) == ([e] if retried else [])


def test_a_night_mixes_retry_and_hard_failure(tmp_path):
    flaky, broken = _entry(tmp_path, "flaky"), _entry(tmp_path, "broken", nan_at=3)
    night = {"entries": [flaky, broken]}
    results = [_judge(tmp_path, flaky, "NODE_FAIL"), _judge(tmp_path, broken, "COMPLETED")]
    assert [e["recipe"] for e in nightly.to_retry(night, results)] == ["flaky"]
    assert results[1]["verdict"]["status"] == "hard_failure"


def test_the_latest_night_is_the_newest_stamp_and_none_before_the_first(tmp_path):
    assert nightly.latest_night(tmp_path) is None
    for stamp in ("20261201-020000", "20261202-020000"):
        (tmp_path / stamp).mkdir()
        (tmp_path / stamp / "night.json").write_text("{}")
    assert nightly.latest_night(tmp_path).name == "20261202-020000"


def test_a_night_on_a_torch_profiler_cluster_plans_each_run_with_the_pytorch_profiler(tmp_path):
    """A cluster profile with profiler = "torch": the dry run says each run's window as it would be typed, and the
    shape plans (Bridge's real config) with the PyTorch profiler on those steps, nsys off."""
    import dataclasses

    from overlapkit.bridge.build import make_plan
    from overlapkit.cluster.profiles import load_profile

    name = "llama3_8b_pretrain_8gpu_h100_bf16"
    profile = dataclasses.replace(load_profile("local"), profiler="torch", job_dir=str(tmp_path / "jobs"))
    said = []
    req = nightly.NightRequest(
        profile=profile, recipes=[name], report_command=REPORT_COMMAND, max_nodes=8, dryrun=True, bridge=submission
    )
    assert nightly.submit_night(req, lambda text, err=False: said.append(text)) is None
    (line,) = [t for t in said if t.startswith(f"would submit {name}")]
    assert line.endswith(" TORCH_PROFILE=34:36 TORCH_PROFILE_RANKS=0")
    shape = nightly.shape_for(name, submission.layout_of(name), profiler="torch_profile")
    plan = make_plan(name, nodes=shape.nodes, sets=shape.sets, run=nightly.run_options(shape.to_dict()))
    p = plan.cfg.profiling
    assert p.use_pytorch_profiler and not p.use_nsys_profiler and (p.profile_step_start, p.profile_step_end) == (34, 36)
    assert p.profile_ranks == [0] and plan.report.ok
    assert plan.to_dict()["run"]["torch_profile"] == {"steps": [34, 36], "ranks": [0]}


def test_a_failed_jobs_row_names_its_first_error_and_a_planted_log_is_said_not_read(tmp_path, within):
    e = _entry(tmp_path, "a")
    d = Path(e["run_dir"])
    (d / "train.log").write_text(
        "Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'nvidia_resiliency_ext'\n"
        "RuntimeError: a | in a message\n"
    )
    os.mkfifo(d / "planted.log")  # in a shared job directory, by anyone: never read, said in the row
    with within(20):
        res = night_report.evaluate(e, "FAILED", [d / "planted.log", d / "train.log"], tmp_path / "g", False)
    assert res["first_error"] == f"ModuleNotFoundError: No module named 'nvidia_resiliency_ext' ({d / 'train.log'})"
    assert res["unreadable_logs"] == [
        f"{d / 'planted.log'}: is not a regular file (a FIFO, socket or device): give the file itself"
    ]
    row = night_report._row(res, None)
    assert "first error: ModuleNotFoundError: No module named 'nvidia_resiliency_ext'" in row
    assert f"log not read: {d / 'planted.log'}: is not a regular file" in row
    assert night_report._row(_judge(tmp_path, _entry(tmp_path, "ok"), "COMPLETED"), None).count("first error") == 0
