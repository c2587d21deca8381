"""GPU=h200 as a user types it: `make plan` in a new process (served where the plan server is on) plans an H100
recipe for H200 nodes: H200's HBM budget, its prediction, the line saying the recipe was written for H100, and the
per-overlap worth (here on an MoE recipe, where the EP overlap's shows)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from overlapkit import paths
from overlapkit.sizing import memory
from overlapkit.sizing.hardware import HARDWARE

QWEN = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"


def test_make_plan_gpu_h200_plans_an_h100_recipe_for_h200(planned):
    cmd = ["make", "-s", "plan", f"RECIPE={QWEN}", "GPU=h200", "FORMAT=json"]
    out = subprocess.run(cmd, cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    h100 = planned(QWEN)  # the same recipe as shipped, for H100
    assert d["gpu"] == d["throughput"]["gpu"] == "h200" and h100.to_dict()["gpu"] == "h100"
    assert d["memory"]["budget_gb"] == pytest.approx(HARDWARE["h200"].hbm_gb - memory.MARGIN_GB)
    assert d["memory"]["total_gb"] == pytest.approx(h100.memory.total_gb, abs=0.01)  # same layout, bigger card
    assert d["throughput"]["step_time_s"] < h100.throughput.step_s  # faster HBM: a shorter optimizer step
    assert d["gpu_note"].startswith("GPU=h200: an h100 recipe planned for H200 SXM")
    assert h100.to_dict()["gpu_note"] is None  # the shipped GPU: no note
    worth = d["throughput"]["overlap_worth"]
    assert next(iter(worth)) == "ep" and worth["ep"]["delta_s"] > 0 and "tp" not in worth
    assert d["audit"]["ok"] and d["audit"]["errors"] == []  # the H100 userbuffers presets are an H200's too
    rec = json.loads((Path(d["run_dir"]) / "overrides.json").read_text())
    assert rec["gpu"] == "h200"  # the job rebuilds the plan for the same GPU (spec/request.py from_record)
