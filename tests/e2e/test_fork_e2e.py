"""A fork as a user makes it: `make new-recipe` with the shape as make variables writes <dir>/<name>.py, then new
processes — `make plan` and `make recipes` — find it through RECIPES_PATH, as the `note:` line new-recipe prints says
(no listing anywhere: the registry discovers the directory). The fork goes to a temporary directory (ARGS=
--recipes-dir), so the test never writes into the real recipes/."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from overlapkit import stack
from overlapkit.plan import registry

NAME = "llama3_34b_pretrain_32gpu_h100_bf16"


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", *args], cwd=stack.REPO_ROOT, capture_output=True, text=True, timeout=900, env=env
    )


def test_new_recipe_then_plan_and_recipes_in_new_processes(tmp_path):
    made = make(
        "new-recipe",
        "FROM=llama3_70b_pretrain_64gpu_h100_bf16",
        f"NAME={NAME}",
        "LAYERS=48",
        "FFN=22016",
        f"ARGS=--recipes-dir {tmp_path}",
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / f"{NAME}.py").is_file() and not (stack.REPO_ROOT / "recipes" / f"{NAME}.py").exists()
    # Outside recipes/: new-recipe tells the user the path the next process needs, and the test follows it.
    assert f"note: make plan finds it with {registry.PATH_VAR}={tmp_path} " in made.stdout
    env = {**os.environ, registry.PATH_VAR: str(tmp_path)}
    plan = make("plan", f"RECIPE={NAME}", "FORMAT=json", env=env)
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    assert got["recipe"] == NAME and got["audit"]["ok"] and got["layout"]["gpus"] == 32
    assert got["layout"]["params_b"] == pytest.approx(35.3, abs=0.1)  # the 48-layer shape, not the 70B's
    listed = make("recipes", env=env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.strip().startswith(NAME))
    assert "Llama3 34B" in row and row.rstrip().endswith("OK")
