"""End to end on the real local Slurm: `make nightly CLUSTER=local PREFLIGHT=1` submits every recipe that fits the
8 fake nodes in its nightly shape (preflight-only: this machine has no GPU), plus the summary job with
`--dependency=afterany:<all>`; the summary job must start after every run ended and write the report."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest

from overlapkit.cluster import slurm
from overlapkit.nightly import night_report

pytestmark = pytest.mark.slurm


def _times(job_id: str) -> tuple[dt.datetime, dt.datetime]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Start,End"], capture_output=True, text=True)
    start, end = out.stdout.strip().splitlines()[0].split("|")
    return dt.datetime.fromisoformat(start), dt.datetime.fromisoformat(end)


def test_make_nightly_preflight_submits_the_suite_and_the_report_runs_last(preflight_night):
    out, jobs = preflight_night  # `make nightly CLUSTER=local PREFLIGHT=1 JOB_DIR=...`, typed once (tests/conftest.py)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("skip llama31_405b") == 4 and "needs 32 nodes at DP=2" in out.stdout
    # the MoE shapes keep EP (nightly/nightly): 235B and DeepSeek-V3 need more than the local 8 nodes
    assert out.stdout.count("skip qwen3_235b") == 2 and out.stdout.count("skip deepseek_v3") == 2
    (night_dir,) = [d for d in (jobs / "nightly").iterdir() if d.is_dir()]  # beside it: history.jsonl, once reported
    night = json.loads((night_dir / "night.json").read_text())
    ids = [e["job_id"] for e in night["entries"] if e.get("job_id")]
    assert len(ids) == 10 and night["preflight_only"]  # 6 dense + Qwen3 30B-A3B and GPT-OSS, two dtypes each
    state = slurm.wait_for(night["report_job_id"], timeout=1800, poll=0.5).split()[0]
    assert state == "COMPLETED", (night_dir / f"report-{night['report_job_id']}.out").read_text()[-3000:]
    report_start, _ = _times(night["report_job_id"])
    assert all(report_start >= _times(i)[1] for i in ids)  # afterany: the summary ran after every run ended
    report = (night_dir / "report.md").read_text()
    assert report.count("preflight only — no training on this machine") == 10
    assert report.count("| skipped |") == 8 and "OK 64/64 ranks" in report and "OK 8/8 ranks" in report
    assert "tp_comm_overlap" in report and "overlap_grad_reduce" in report and "ep_a2a_overlap" in report
    # issue #24: every run profiles two steady steps on rank 0 of each node, planned as NSYS=; no column on a
    # preflight night, and the report says why rather than leaving it blank
    for e in (e for e in night["entries"] if e.get("job_id")):
        plan = json.loads((Path(e["run_dir"]) / "plan.json").read_text())
        assert plan["run"]["nsys"] == {"steps": [33, 35], "ranks": list(range(0, 8 * e["nodes"], 8))}, e["recipe"]
        assert (e["nsys"], e["nsys_ranks"]) == ("33:35", ",".join(map(str, range(0, 8 * e["nodes"], 8))))
    assert report.count("| — (preflight only: no training, so no profile) |") == 10
    hist = night_report.read_history(jobs / "nightly" / "history.jsonl")
    assert {r["status"] for r in hist} == {"preflight_only"} and len(hist) == 10
