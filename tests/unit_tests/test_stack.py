"""Foundation: the real pinned stack imports on CPU, Bridge recipes build offline, nemo_run objects construct."""

from __future__ import annotations

import importlib
import io
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from overlapkit import paths
from overlapkit.bridge import stack, te_stub


def test_installed_versions_equal_the_pins():
    assert stack.versions(stack.PINNED) == stack.PINNED
    assert stack.version_drift() == []


def test_a_drifted_install_is_a_warning_under_the_plan_header(monkeypatch):
    from overlapkit.bridge.build import make_plan
    from overlapkit.bridge.report import render_plan
    from overlapkit.profile.overlap_render import console

    monkeypatch.setitem(stack.PINNED, "megatron-core", "0.0.1")  # as if the lock had moved past the installed one
    out = io.StringIO()
    render_plan(make_plan("llama3_8b_pretrain_8gpu_h100_bf16"), console(file=out, width=200))
    header = out.getvalue().splitlines()[:3]  # the recipe, its source, then the drift
    assert header[2] == "warning megatron-core 0.19.2 is installed but this repo pins 0.0.1: run `make setup`"


def test_pins_in_pyproject_match_stack_pins():
    deps = tomllib.loads((paths.REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, version in stack.PINNED.items():
        assert f"{name}=={version}" in deps


def test_megatron_core_still_believes_te_is_absent():
    # The shim must not leak: megatron-core's own probes see no TE, and no placeholder stays importable.
    from megatron.bridge.training import comm_overlap
    from megatron.core.models.gpt import gpt_layer_specs

    assert comm_overlap.HAVE_TE is False
    assert gpt_layer_specs.HAVE_TE is False
    assert not [m for m in sys.modules if m.startswith("transformer_engine")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine")


def test_te_placeholders_fail_loudly_when_used():
    from megatron.bridge.models import gpt_full_te_layer_autocast_spec as spec

    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        spec.TransformerLayer()
    assert "transformer_engine" not in sys.modules  # gone as soon as the importer's body finished
    assert te_stub.real_te_available() is False


def test_bridge_llama3_70b_recipe_builds_offline_on_cpu():
    from megatron.bridge.recipes.llama import llama3_70b_pretrain_config
    from megatron.bridge.training.comm_overlap import userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192

    cfg = llama3_70b_pretrain_config()
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (80, 8192, 28672)
    assert (m.num_attention_heads, m.num_query_groups, m.seq_length) == (64, 8, 8192)
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) == (4, 4)
    assert (m.virtual_pipeline_model_parallel_size, m.context_parallel_size) == (5, 2)
    assert m.sequence_parallel is True and m.pipeline_dtype == torch.bfloat16
    assert cfg.comm_overlap.tp_comm_overlap is True
    assert cfg.comm_overlap.tp_comm_overlap_cfg is userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192
    assert cfg.ddp.use_distributed_optimizer is True


# --- the runs root: OVERLAPKIT_RUNS, the one setting for where the product writes what it keeps for you ------------


def runs_places() -> dict:
    """Every place the product puts under runs/, as the product computes it."""
    from launch import calibrate
    from overlapkit.cluster import submit
    from overlapkit.cluster.profiles import load_profile
    from overlapkit.sizing import calibration

    args = calibrate.parse(["--cluster", "local"])
    calibrate.check(args)
    return {
        "local profile job_dir": load_profile("local").job_path,
        "run-local": submit.local_runs(),
        "calibration": calibration.path_of("c").parent,
        "a profile's runs/x": paths.in_checkout("runs/x"),
        "calibrate searches": args.roots[0] if args.roots else None,
    }


def test_unset_the_runs_root_is_the_checkouts_runs(monkeypatch):
    from overlapkit.sizing import calibration

    monkeypatch.delenv(paths.RUNS_VAR)
    monkeypatch.delenv(calibration.DIR_VAR, raising=False)
    runs = paths.REPO_ROOT / "runs"
    assert paths.runs_root() == runs and paths.in_checkout("slurm/profiles") == paths.REPO_ROOT / "slurm/profiles"
    places = runs_places()
    expect = [runs / "slurm", runs / "local", runs / "calibration", runs / "x"]
    assert list(places.values())[:4] == expect
    assert places["calibrate searches"] in (runs, None)  # none when the checkout has no runs/ yet


def test_overlapkit_runs_moves_every_place_under_runs(monkeypatch, tmp_path):
    from overlapkit.sizing import calibration

    monkeypatch.setenv(paths.RUNS_VAR, str(tmp_path / "r"))
    monkeypatch.delenv(calibration.DIR_VAR, raising=False)
    (tmp_path / "r").mkdir()
    places = runs_places()
    assert all(p.is_relative_to(tmp_path / "r") for p in places.values()), places
    assert places["calibrate searches"] == tmp_path / "r"


def test_a_relative_overlapkit_runs_is_refused_in_one_line(monkeypatch, make_here):
    monkeypatch.setenv(paths.RUNS_VAR, "scratch/runs")
    code, out, err = make_here("plan", "RECIPE=llama3_8b_pretrain_8gpu_h100_bf16")
    assert code == 2, out + err
    fix = "OVERLAPKIT_RUNS=scratch/runs: not an absolute path: give a /directory, or unset it (the checkout's runs/)"
    assert fix in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_suites_runs_go_to_a_folder_of_its_own(make_here):
    """tests/conftest.py points OVERLAPKIT_RUNS at a temporary folder: a plan the suite makes is written there, and the
    checkout's runs/ (where your `make status` and `make calibrate` look) gains nothing."""
    mine = paths.REPO_ROOT / "runs"
    before = set(mine.iterdir()) if mine.is_dir() else set()
    assert not paths.runs_root().is_relative_to(paths.REPO_ROOT)
    code, out, err = make_here("plan", "RECIPE=llama3_8b_pretrain_8gpu_h100_bf16")
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("run directory: ")]
    assert Path(line.removeprefix("run directory: ")).parent == paths.runs_root()
    assert (set(mine.iterdir()) if mine.is_dir() else set()) == before
