"""Real 1-GPU training through Bridge's pretrain() (bench/gpu_cut.py): skipped without CUDA (marker `gpu`).

By default it trains the Llama3 8B cut on both sides (about two minutes on an H100/H200). Where the full bench has
just run in the same job (tools/gpu_check_on_device.sh), GPU_CUT_RESULTS names its results.json and the same
assertions are made on every cut of that run instead of training again.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
ITERS = 12


def _results(tmp_path: Path) -> dict:
    if path := os.environ.get("GPU_CUT_RESULTS"):
        return json.loads(Path(path).read_text())
    out = tmp_path / "gpu_cut"
    cmd = [sys.executable, "bench/gpu_cut.py", "--only", "llama3_8b", "--iters", str(ITERS), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert (out / "results.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_cuts_train_side_by_side_and_parse(tmp_path):
    doc = _results(tmp_path)
    assert "no TE" in doc["label"] and doc["device"]
    ran = 0
    for key, sides in doc["results"].items():
        for side, res in sides.items():
            if res["status"].startswith("skipped"):  # does not fit this card: allowed, with its estimate
                assert "needs" in res["status"], (key, side, res["status"])
                continue
            assert res["status"] == "ok", (key, side, res["status"], res.get("events"))
            s = res["summary"]
            assert s["iterations"] == s["train_iters"] and s["nan_iterations"] == 0 and s["incomplete_lines"] == 0
            assert s["tflops_per_gpu"] > 1.0 and s["step_time_ms"] > 0 and s["peak_mem_gb"] > 0
            assert math.isfinite(float(s["last_loss"])) and float(s["last_loss"]) < math.log(128256) + 1
            assert res["vs_golden"] in ("pass", "no_golden"), (key, side, res["golden_reasons"])
            ran += 1
    assert ran >= 2  # at least one cut on both sides
