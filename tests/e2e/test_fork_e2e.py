"""A fork as a user makes it: `make new-recipe` with the shape as make variables writes <dir>/<name>.py, then new
processes — `make plan` and `make recipes` — find it through RECIPES_PATH, as the `note:` line new-recipe prints says
(no listing anywhere: the registry discovers the directory). The fork goes to a temporary directory (ARGS=
--recipes-dir), so the test never writes into the real recipes/. The fork is docs/forking.md's MoE example, whose
search once ranked its layout at 189 TFLOP/s where the plan of the file said 218 (issue 40): the numbers the search
prints, the file's docstring and the plan's JSON are one prediction."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from overlapkit import paths
from overlapkit.bridge import registry

NAME = "qwen3_60b_a6b_pretrain_32gpu_h100_bf16"
FORK = ["FROM=qwen3_30b_a3b_pretrain_16gpu_h100_bf16", f"NAME={NAME}", "LAYERS=64", "EXPERTS=256"]


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", *args], cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=900, env=env
    )


def test_new_recipe_then_plan_and_recipes_in_new_processes(tmp_path):
    made = make("new-recipe", *FORK, f"ARGS=--recipes-dir {tmp_path}")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / f"{NAME}.py").is_file() and not (paths.REPO_ROOT / "recipes" / f"{NAME}.py").exists()
    # Outside recipes/: new-recipe tells the user the path the next process needs, and the test follows it.
    assert f"note: make plan finds it with {registry.PATH_VAR}={tmp_path} " in made.stdout
    env = {**os.environ, registry.PATH_VAR: str(tmp_path)}
    plan = make("plan", f"RECIPE={NAME}", "FORMAT=json", env=env)
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    assert got["recipe"] == NAME and got["audit"]["ok"] and got["layout"]["gpus"] == 32
    assert got["layout"]["experts"] == 256 and got["layout"]["params_b"] == pytest.approx(79.2, abs=0.1)
    # The layout the search chose, at the numbers it printed for it, is what the plan of the file predicts.
    chosen = re.search(r"^layout: (.+)$", made.stdout, re.M)[1]
    ranked = re.search(
        rf"^  1\. {re.escape(chosen)}: (\d+) TFLOP/s/GPU, [\d,]+ tokens/s/GPU, ([\d.]+) s/step", made.stdout, re.M
    )
    doc = " ".join((tmp_path / f"{NAME}.py").read_text().split())
    pred = got["throughput"]
    assert float(ranked[1]) == pytest.approx(pred["tflops_per_gpu"], abs=0.5)
    assert float(ranked[2]) == pytest.approx(pred["step_time_s"], abs=0.005)
    assert f"predicted {float(ranked[1]):.0f} TFLOP/s/GPU." in doc and f"Layout {chosen} chosen" in doc
    listed = make("recipes", env=env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.strip().startswith(NAME))
    assert "Qwen3 60B A6B" in row and row.rstrip().endswith("OK")
