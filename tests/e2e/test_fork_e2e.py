"""A fork as a user makes it: `make new-recipe` with the shape as make variables writes recipes/<name>.py, then new
processes — `make plan` and `make recipes` — find it with no listing anywhere (the registry discovers recipes/)."""

from __future__ import annotations

import json
import subprocess

import pytest

from overlapkit import stack

NAME = "llama3_34b_pretrain_32gpu_h100_bf16"
FILE = stack.REPO_ROOT / "recipes" / f"{NAME}.py"


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=stack.REPO_ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture
def fork_file(tmp_path):
    if FILE.exists():
        pytest.fail(f"{FILE} already exists (a user's fork?): move it away to run this test")
    yield FILE
    FILE.unlink(missing_ok=True)


def test_new_recipe_then_plan_and_recipes_in_new_processes(fork_file, tmp_path):
    made = make("new-recipe", "FROM=llama3_70b_pretrain_64gpu_h100_bf16", f"NAME={NAME}", "LAYERS=48", "FFN=22016")
    assert made.returncode == 0, made.stderr
    assert fork_file.is_file() and "RECIPES_PATH" not in made.stdout  # in recipes/: found without a path
    plan = make("plan", f"RECIPE={NAME}", "FORMAT=json")
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    assert got["recipe"] == NAME and got["audit"]["ok"] and got["layout"]["gpus"] == 32
    assert got["layout"]["params_b"] == pytest.approx(35.3, abs=0.1)  # the 48-layer shape, not the 70B's
    listed = make("recipes")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.strip().startswith(NAME))
    assert "Llama3 34B" in row and row.rstrip().endswith("OK")
