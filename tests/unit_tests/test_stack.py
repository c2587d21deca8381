"""Foundation: the real pinned stack imports on CPU, Bridge recipes build offline, nemo_run objects construct."""

from __future__ import annotations

import importlib
import io
import sys
import tomllib

import pytest
import torch

from overlapkit import stack, te_stub


def test_installed_versions_equal_the_pins():
    assert stack.versions(stack.PINNED) == stack.PINNED
    assert stack.version_drift() == []


def test_a_drifted_install_is_a_warning_under_the_plan_header(monkeypatch):
    from overlapkit.plan.build import make_plan
    from overlapkit.plan.report import console, render_plan

    monkeypatch.setitem(stack.PINNED, "megatron-core", "0.0.1")  # as if the lock had moved past the installed one
    out = io.StringIO()
    render_plan(make_plan("llama3_8b_pretrain_8gpu_h100_bf16"), console(file=out, width=200))
    header = out.getvalue().splitlines()[:3]  # the recipe, its source, then the drift
    assert header[2] == "warning megatron-core 0.19.2 is installed but this repo pins 0.0.1: run `make setup`"


def test_pins_in_pyproject_match_stack_pins():
    deps = tomllib.loads((stack.REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
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
