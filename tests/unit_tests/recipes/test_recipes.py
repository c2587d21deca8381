"""Every shipped recipe builds offline on CPU, passes its audit, and matches the committed golden layout table.

Regenerate goldens after an intended change with `UPDATE_GOLDEN=1 make test PYTEST_ARGS=-k golden`, then review the
diff like code.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from launch import commands
from overlapkit import paths
from overlapkit.bridge import build, registry
from overlapkit.bridge.build import make_plan, write_run_dir
from overlapkit.bridge.report import render_plan
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import Overlap
from overlapkit.spec.shape import ModelShape

GOLDEN = paths.REPO_ROOT / "tests" / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def layout_row(p) -> dict:
    return {**p.layout, "overlaps": {r.name: r.state for r in p.report.rows}, "audit_ok": p.report.ok}


def check_golden(path, actual: str):
    if UPDATE:
        path.write_text(actual)
    assert path.read_text() == actual, f"{path.name} differs from the plan; review, then UPDATE_GOLDEN=1"


# The recipes this repo ships. A user's fork (make new-recipe) adds to registry.names(): it is built and audited by
# the parametrized tests below, while the golden table stays about the shipped eighteen.
DENSE = [
    f"{m}_pretrain_{g}gpu_h100_{d}"
    for m, g in [
        ("llama3_8b", 8),
        ("llama3_70b", 64),
        ("llama31_405b", 512),
        ("llama31_405b", 1024),
        ("gpt3_175b", 128),
    ]
    for d in ("bf16", "fp8cs")
]
MOE = [
    f"{m}_pretrain_{g}gpu_h100_{d}"
    for m, g in [("qwen3_30b_a3b", 16), ("qwen3_235b_a22b", 256), ("deepseek_v3", 1024), ("gpt_oss_120b", 64)]
    for d in ("bf16", "fp8cs")
]
SHIPPED = DENSE + MOE


def test_the_eighteen_shipped_recipes_cover_the_eight_models_and_both_dtypes():
    names = SHIPPED
    assert set(names) <= set(registry.names()) and len(names) == 18
    assert {registry.get(n).model for n in DENSE} == {"Llama3 8B", "Llama3 70B", "Llama3.1 405B", "GPT3 175B"}
    assert {registry.get(n).model for n in MOE} == {"Qwen3 30B-A3B", "Qwen3 235B-A22B", "DeepSeek-V3", "GPT-OSS 120B"}
    assert {n.rsplit("_", 1)[1] for n in names} == {"bf16", "fp8cs"}
    for n in registry.names():
        r = registry.get(n)
        # The name starts with the model label ("Llama3.1 405B" → llama31_405b), with the GPU count of its nodes.
        label = r.model.lower().replace(" ", "_").replace(".", "").replace("-", "_")
        assert n.startswith(label + "_pretrain_"), n
        assert f"_{r.nodes * 8}gpu_" in n, n
        assert f"_{r.nodes * 8}gpu_h100_" in n and r.source and r.time_limit.count(":") == 2


# What the pinned stack itself warns when a shipped recipe starts (the plan shows each: bridge/startup.py), each with
# why the recipe keeps it. A warning a stack upgrade adds fails here until someone reads it and adds it, or mends it.
STACK_WARNS_SHIPPED = {
    "Transformer Engine cross entropy loss fusion has known stability issues": "NVIDIA's perf recipes fuse the loss "
    "in TE (cross_entropy_fusion_impl='te'); Megatron-LM's argument check refuses it, Bridge's does not",
    "Using a large number of experts (e.g. >=32) without fp32 routing": "NVIDIA's MoE perf recipes route in BF16",
    "`hf_tokenizer_kwargs` is deprecated": "Bridge's own Qwen3 tokenizer config",
    "apply_rope_fusion for multi-latent attention only supports training": "DeepSeek-V3 (MLA): a training run",
    "moe_hybridep_num_sms is deprecated": "Bridge's MoE perf recipes set the field Core 0.19 renamed",
}


@pytest.mark.parametrize("name", registry.names())
def test_recipe_builds_offline_passes_the_audit_and_has_no_warnings(name, planned):
    """No warning of the audit's own; the stack's start-up warnings only those listed with their reason."""
    p = planned(name)  # the fixture checks the pure builder: no environment writes
    assert p.report.ok, [f.message for f in p.report.errors]
    ours = [f for f in p.report.warnings if f.code != "stack_warns"]
    assert ours == []
    unread = [
        f.message
        for f in p.report.warnings
        if f.code == "stack_warns" and not any(w in f.message for w in STACK_WARNS_SHIPPED)
    ]
    assert unread == [], "a stack warning no one has read: add it to STACK_WARNS_SHIPPED with why, or mend the recipe"
    # Every overlap is on, n/a, or kept off by the recipe's declaration, with its reason (OverlapIntent.off).
    kept = dict(p.intent.off)
    for name in Overlap:
        row = next((r for r in p.report.rows if r.name == name), None)
        if row is not None and row.state not in ("on", "n/a"):
            assert kept.get(name) and kept[name] in row.detail, (row, kept)
    tp_state = "n/a" if p.layout["tp"] == 1 else "off" if "tp_comm_overlap" in kept else "on"
    assert p.report.row("tp_comm_overlap").state == tp_state


def test_layout_table_matches_golden(planned):
    table = {name: layout_row(planned(name)) for name in SHIPPED}
    check_golden(GOLDEN / "recipes_layout.json", json.dumps(table, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", ["llama3_70b_pretrain_64gpu_h100_bf16", "llama3_8b_pretrain_8gpu_h100_fp8cs"])
def test_plan_output_matches_golden(name, planned):
    buf = io.StringIO()
    plan = planned(name)  # no shell exports: the submitting shell's are not part of the golden
    render_plan(plan, Console(file=buf, width=120, color_system=None, highlight=False))
    check_golden(GOLDEN / f"plan_{name}.txt", buf.getvalue())


@pytest.mark.parametrize(
    ("hf", "name"),
    [
        ("Meta-Llama-3-8B", "llama3_8b_pretrain_8gpu_h100_bf16"),
        ("Meta-Llama-3-70B", "llama3_70b_pretrain_64gpu_h100_bf16"),
        ("Meta-Llama-3.1-405B", "llama31_405b_pretrain_512gpu_h100_bf16"),
    ],
)
def test_shipped_hf_configs_reach_the_megatron_provider(hf, name):
    snap = paths.HF_CACHE / f"models--meta-llama--{hf}" / "snapshots" / "config-only" / "config.json"
    hf_cfg = json.loads(snap.read_text())
    m = registry.get(name).build().model
    assert (m.hidden_size, m.ffn_hidden_size, m.num_layers) == (
        hf_cfg["hidden_size"],
        hf_cfg["intermediate_size"],
        hf_cfg["num_hidden_layers"],
    )
    assert (m.num_attention_heads, m.num_query_groups, m.vocab_size) == (
        hf_cfg["num_attention_heads"],
        hf_cfg["num_key_value_heads"],
        hf_cfg["vocab_size"],
    )


# GPT3: tied embeddings and Bridge's NullTokenizer vocab (32000) on mock data.
@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama3_8b_pretrain_8gpu_h100_bf16", 8.0),
        ("llama3_70b_pretrain_64gpu_h100_bf16", 70.6),
        ("llama31_405b_pretrain_512gpu_h100_bf16", 405.8),
        ("gpt3_175b_pretrain_128gpu_h100_bf16", 174.3),
    ],
)
def test_parameter_counts_match_the_model_names(name, billions):
    cfg = registry.get(name).build()
    assert ModelShape.of(cfg).total_params / 1e9 == pytest.approx(billions, abs=0.1)


# --- overrides in both directions --------------------------------------------------------------------------------

R70 = "llama3_70b_pretrain_64gpu_h100_bf16"


def test_sequence_parallel_off_on_70b_fails_with_the_fix_and_back_on_passes():
    off = make_plan(R70, sets="model.sequence_parallel=false")
    assert not off.report.ok and "model.sequence_parallel=true" in off.report.errors[0].message
    assert make_plan(R70, sets="model.sequence_parallel=true").report.ok  # one key once: a repeat is refused


def test_param_gather_with_optimizer_step_opt_in_turns_it_on():
    p = make_plan(R70, sets="overlap.param_gather_with_optimizer_step=true checkpoint.save=null")
    assert p.report.row("overlap_param_gather_with_optimizer_step").state == "on" and p.report.ok
    assert p.changes[0] == ("overlap.param_gather_with_optimizer_step", None, True)


def test_switching_dp_overlap_off_and_on():
    assert "overlap_param_gather_off" in make_plan(R70, sets="comm_overlap.overlap_param_gather=false").report.codes()
    assert make_plan(R70, sets="comm_overlap.overlap_param_gather=true").report.ok


def test_global_batch_and_nodes_change_the_plan():
    p = make_plan(R70, nodes=16, sets="train.global_batch_size=512")
    assert (p.layout["gpus"], p.layout["dp"], p.layout["gbs"]) == (128, 4, 512) and p.report.ok
    assert p.changes == [("train.global_batch_size", 256, 512)]


def test_micro_batch_2_on_gpt3_warns_about_the_mbs1_preset():
    # MBS 2 alone is beyond an H100's memory (memory_does_not_fit); one recomputed layer per stage brings it back
    full = "model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1"
    p = make_plan("gpt3_175b_pretrain_128gpu_h100_bf16", sets=f"train.micro_batch_size=2 {full}")
    assert p.report.ok and p.report.codes("warning") == {"preset_tuning_mismatch"}


# --- the CLI: exit codes, one-line errors, run directory ---------------------------------------------------------


def cli(capsys, *argv):
    code = commands.call("plan", list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["llama3_70b"], "closest: llama3_70b_pretrain_64gpu_h100_bf16"),
        ([R70, "--set", "train.global_batch_sz=1"], "did you mean train.global_batch_size?"),
        ([R70, "--set", "train.global_batch_size=abc"], "expected an integer"),
        ([R70, "--set", "model.sequence_parallel=maybe"], "expected true or false"),
        ([R70, "--set", "overlap.tp_presets=default"], "did you mean overlap.tp_preset?"),
        ([R70, "--set", "train.global_batch_size"], "is not KEY=VALUE"),
        ([R70, "--nodes", "3"], "multiple of 32"),
        ([R70, "--nodes", "two"], "whole number"),
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_2(capsys, tmp_path, argv, needle):
    code, out, err = cli(capsys, *argv, "--runs", str(tmp_path))
    assert code == 2 and out == "" and needle in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []  # nothing written for a plan that was never made


def test_audit_failure_exits_1_with_reasons_on_stderr(capsys, tmp_path):
    code, out, err = cli(capsys, R70, "--set", "model.sequence_parallel=false", "--runs", str(tmp_path))
    assert code == 1 and "error: [tp_overlap_dropped]" in err and "audit: 1 error(s)" in out


def test_json_plan_and_run_directory(capsys, tmp_path):
    code, out, _ = cli(capsys, R70, "--format", "json", "--runs", str(tmp_path))
    data = json.loads(out)
    assert code == 0 and data["audit"]["ok"] and data["layout"]["tp"] == 4
    run_dir = tmp_path / os.path.basename(data["run_dir"])
    assert json.loads((run_dir / "plan.json").read_text())["recipe"] == R70
    yaml_text = (run_dir / "config.yaml").read_text()
    assert "tp_comm_overlap: true" in yaml_text and "overlap_p2p_comm: true" in yaml_text


def test_a_plan_is_a_frozen_record_of_its_stages_with_one_type_of_finding(tmp_path):
    p = make_plan(R70, sets="model.sequence_parallel=false", caller_env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.report = None
    a = build.audited(build.built(p.request), caller_env={})  # each stage: the record before it, and what it adds
    assert isinstance(a, build.Built) and not isinstance(a, build.Sized) and a.report.rows == p.report.rows
    assert p.report.findings[: len(a.report.findings)] == a.report.findings  # the run's and memory's come after
    assert all(type(f) is Finding for f in p.report.findings) and p.report.errors[0].code == "tp_overlap_dropped"
    first = p.to_dict()["audit"]["errors"][0]
    assert first == p.report.errors[0]._asdict() and list(first) == ["level", "code", "message", "fix"]
    run_dir = write_run_dir(p, tmp_path)  # named in its plan.json; the plan itself names none
    assert json.loads((run_dir / "plan.json").read_text())["run_dir"] == str(run_dir) and not p.to_dict()["run_dir"]


def test_run_directories_never_overwrite(tmp_path):
    p = make_plan(R70)
    a, b = write_run_dir(p, tmp_path, stamp="x"), write_run_dir(p, tmp_path, stamp="x")
    assert a != b and a.exists() and b.exists()


def test_config_yaml_is_bridges_dump_written_through_no_planted_link(tmp_path, monkeypatch):
    """A link planted in the new run directory (between its mkdir and the writes) is replaced, never followed; the
    file holds what Bridge's own ConfigContainer.to_yaml writes."""
    target, real_mkdir = tmp_path / "precious", Path.mkdir
    target.write_text("keep")

    def mkdir_then_plant(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.parent == tmp_path / "runs":
            (self / "config.yaml").symlink_to(target)

    p = make_plan(R70)
    monkeypatch.setattr(Path, "mkdir", mkdir_then_plant)
    run_dir = write_run_dir(p, tmp_path / "runs", stamp="x")
    monkeypatch.undo()
    assert target.read_text() == "keep" and not (run_dir / "config.yaml").is_symlink()
    cfg = copy.copy(p.cfg)
    cfg.model, cfg.optimizer, cfg.ddp, cfg.comm_overlap = (
        p.resolved.model,
        p.resolved.optimizer,
        p.resolved.ddp,
        p.resolved.comm,
    )
    cfg.to_yaml(str(tmp_path / "bridge.yaml"))
    assert (run_dir / "config.yaml").read_text() == (tmp_path / "bridge.yaml").read_text()


def test_recipes_list(capsys):
    code, out, _ = cli(capsys, "--list")
    assert code == 0 and all(n in out for n in registry.names()) and out.count(" OK") == len(registry.names())


@pytest.mark.parametrize("name", SHIPPED)
def test_the_recorded_model_inputs_predict_the_plans_step(name, planned, tmp_path):
    """inputs.json, read back as make calibrate reads it (no Bridge), predicts exactly the step plan.json quotes: the
    record holds every input the model reads (the MoE settings, DeepSeek-V3's first-stage chunks among them)."""
    from overlapkit.sizing import throughput

    plan = planned(name)
    inputs = throughput.read_inputs(write_run_dir(plan, tmp_path))
    assert inputs.predict().step_s == plan.throughput.step_s
