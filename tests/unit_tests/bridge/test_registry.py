"""The recipe registry: the shipped recipes register with their intent, and a new process discovers every module in
recipes/ and RECIPES_PATH by itself, reporting a broken module in one line while the others still list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from overlapkit import paths
from overlapkit.bridge import registry
from overlapkit.spec.overlap import OverlapIntent

GOOD = """
from megatron.bridge.recipes.llama import llama3_8b_pretrain_config as base

from recipes._base import Layout, OverlapIntent, h100_pretrain, register


INTENT = OverlapIntent(param_gather_with_optimizer_step=True)


@register(model="Llama3 8B", nodes=2, source="mine", intent=INTENT)
def mine_8b_pretrain_16gpu_h100_bf16():
    return h100_pretrain(base, "bf16", Layout(tp=1, pp=1, cp=1, vpp=None, mbs=1, gbs=128, seq=8192), INTENT)
"""
BROKEN = "from recipes._base import register\n\nraise RuntimeError('half-written\\nfile')\n"


def test_shipped_recipes_register_their_default_intent():
    names = registry.names()
    assert len(names) >= 10 and registry.load_errors() == []
    r = registry.get("llama3_70b_pretrain_64gpu_h100_bf16")
    assert r.intent == OverlapIntent() and r.nodes * 8 == 64 and r.build.__module__ == "recipes.llama3_70b"


def test_the_table_the_registry_reads_before_the_import_is_what_the_modules_register():
    import recipes

    registered: dict[str, set] = {}
    for name in filter(registry.shipped, registry.names()):
        registered.setdefault(registry.get(name).build.__module__.removeprefix("recipes."), set()).add(name)
    assert registered == {module: set(names) for module, names in recipes.RECIPES.items()}


def test_a_name_whose_gpus_are_not_its_nodes_is_refused():
    """declared_nodes reads the nodes from the name before the import: register makes that the registered value."""
    build = registry.get("llama3_8b_pretrain_8gpu_h100_bf16").build

    def mine_pretrain_16gpu_h100_bf16():
        return build()

    with pytest.raises(ValueError, match="names 16 GPUs but registers nodes=3: make them agree"):
        registry.register(model="x", nodes=3, source="x")(mine_pretrain_16gpu_h100_bf16)


def test_unknown_recipe_names_the_closest():
    with pytest.raises(registry.UnknownRecipe, match="closest: llama3_70b_pretrain_64gpu_h100_bf16"):
        registry.get("llama3_70b_pretrain_64gpu_h100")


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(model="x", nodes=1, source="x")(registry.get("llama3_8b_pretrain_8gpu_h100_bf16").build)


def test_a_new_process_discovers_a_users_file_and_reports_a_broken_one(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent(GOOD))
    (tmp_path / "half.py").write_text(BROKEN)
    env = {**os.environ, registry.PATH_VAR: str(tmp_path)}

    def plan(name, *args):  # `make recipes` / `make plan` in a new process (served or not: recipes/ read fresh)
        cmd = [sys.executable, "-m", "launch", name, *args, "--runs", str(tmp_path / "runs")]
        return subprocess.run(cmd, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)

    listed, mine = plan("recipes"), plan("plan", "mine_8b_pretrain_16gpu_h100_bf16", "--format", "json")
    broken = f"error: {tmp_path / 'half.py'} does not import: RuntimeError: half-written file"
    assert listed.returncode == 1 and listed.stderr.splitlines() == [broken]  # the others still list
    assert (
        "mine_8b_pretrain_16gpu_h100_bf16" in listed.stdout and "llama3_70b_pretrain_64gpu_h100_bf16" in listed.stdout
    )
    assert mine.returncode == 0 and mine.stderr.splitlines() == [broken.replace("error:", "warning:")], mine.stderr
    got = json.loads(mine.stdout)
    # the intent registered with the recipe reached the plan
    assert got["audit"]["ok"] and got["audit"]["rows"]["overlap_param_gather_with_optimizer_step"]["state"] == "on"


def test_a_file_named_for_a_recipe_registers_that_one_alone(tmp_path):
    """Its name is what the registry declared before the import: a file that registers another is a load error."""
    (tmp_path / "other_pretrain_16gpu_h100_bf16.py").write_text(textwrap.dedent(GOOD))
    env = {**os.environ, registry.PATH_VAR: str(tmp_path)}
    cmd = [sys.executable, "-m", "launch", "recipes", "--runs", str(tmp_path / "runs")]
    listed = subprocess.run(cmd, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    said = "a file named for recipe other_pretrain_16gpu_h100_bf16 registers that one alone, not ['mine_8b_pretrain"
    assert listed.returncode == 1 and said in listed.stderr and "mine_8b" not in listed.stdout


def test_finds_knows_where_a_new_process_looks(tmp_path, monkeypatch):
    assert registry.finds(paths.REPO_ROOT / "recipes" / "x.py")
    assert not registry.finds(tmp_path / "x.py")
    monkeypatch.setenv(registry.PATH_VAR, str(tmp_path))
    assert registry.finds(tmp_path / "x.py")
