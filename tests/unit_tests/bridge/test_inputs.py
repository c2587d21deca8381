"""Bad input before the Bridge import, and after the build: every size a user is likely to touch at 0, -1 and a
non-integer is a one-line error on both paths (never a ZeroDivisionError, never "audit: OK"); a key the request does
not type is left to Bridge's override path; an override that Bridge replaces is an error naming the field that wins;
and every fix an audit finding suggests, applied as SET, clears that finding without raising another."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap

import pytest

from overlapkit import paths
from overlapkit.bridge import build, inputs, overrides, registry
from overlapkit.bridge.build import make_plan
from overlapkit.bridge.overrides import OverrideError

R70 = "llama3_70b_pretrain_64gpu_h100_bf16"
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
Q30 = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"  # 128 experts, top-8, head dim 128 on hidden 2048 / 32 heads
# The numeric fields a user is likely to touch: parallel sizes, batch sizes, sequence length, shape, bucket, iterations.
TOUCHED = [
    "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size", "model.context_parallel_size",
    "model.virtual_pipeline_model_parallel_size", "model.expert_model_parallel_size", "train.global_batch_size",
    "train.micro_batch_size", "model.seq_length", "dataset.sequence_length", "model.num_layers", "model.hidden_size",
    "model.num_attention_heads", "model.num_query_groups", "model.ffn_hidden_size", "ddp.bucket_size",
    "comm_overlap.bucket_size", "train.train_iters", "logger.log_interval", "validation.eval_interval",
]  # fmt: skip
MATRIX = [(key, value) for key in TOUCHED for value in ("0", "-1", "1.5")]


@pytest.mark.parametrize(("key", "value"), MATRIX, ids=[f"{k}={v}" for k, v in MATRIX])
def test_bad_sizes_are_refused_before_the_import(key, value):
    with pytest.raises(OverrideError) as exc:
        inputs.check_sets(f"{key}={value}")
    msg = str(exc.value)
    assert "\n" not in msg and key in msg
    assert ("must be a whole number" in msg) if value != "1.5" else ("expected an integer" in msg)


@pytest.mark.parametrize(("key", "value"), MATRIX, ids=[f"{k}={v}" for k, v in MATRIX])
def test_bad_sizes_never_reach_a_division_after_the_import(key, value):
    """The plan's own path (a fork's file or a base recipe can carry a bad size that no SET check sees)."""
    with pytest.raises(ValueError) as exc:  # OverrideError or PlanError, both one line
        make_plan(R70, sets=f"{key}={value}")
    assert "\n" not in str(exc.value) and key in str(exc.value)


def test_a_bad_size_in_the_built_config_is_a_plan_error():
    cfg = registry.get(R70).build()
    cfg.train.micro_batch_size, cfg.model.num_layers = 0, -2
    assert inputs.size_problems(cfg) == ["model.num_layers=-2: must be a whole number ≥ 1 and ≤ 2,016",
                                         "train.micro_batch_size=0: must be a whole number ≥ 1"]  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        ("model.sequence_parallel=yes please", "is not KEY=VALUE"),
        ("checkpoint.save=hf_abcdefghijklmnopqrstuvwxyz0123456789", "<a Hugging Face token>"),
        ("train.global_batch_size='256", "No closing quotation"),
        ("overlap.tp_presett=x", "did you mean overlap.tp_preset"),
    ],
)
def test_request_errors_before_the_import_are_one_line(sets, needle):
    with pytest.raises(OverrideError, match=needle) as exc:
        inputs.check_sets(sets)
    assert "\n" not in str(exc.value)


def test_valid_sets_pass_the_early_check():
    assert inputs.check_sets("train.global_batch_size=512 dataset.blend=null checkpoint.save=/lustre/ckpt "
                             "model.virtual_pipeline_model_parallel_size=null train.train_iters=100")  # fmt: skip


def test_keys_the_request_does_not_type_are_left_to_bridges_override_path():
    sets = "train.global_batch_sise=5 model.sequence_parallel=1 scheduler.lr_decay_style=cosin model.foo.bar=1"
    assert inputs.check_sets(sets)  # no early error: the field's type and existence are Bridge's to say
    with pytest.raises(
        OverrideError, match=r"^unknown key 'train.global_batch_sise'; did you mean train.global_batch_size\?$"
    ):
        make_plan(R8, sets=sets)


def test_early_checks_never_import_bridge_or_torch():
    code = textwrap.dedent(f"""
        import sys
        from launch import commands
        from overlapkit.errors import BadInput
        for nodes, sets in (("0", ""), ("", "train.global_batch_size=0"), ("", "ddp.bucket_size=1.5")):
            try:
                commands.prepare("plan", [{R70!r}, "--nodes", nodes, "--set", sets])
                raise AssertionError((nodes, sets))
            except BadInput:
                pass
        assert commands.prepare("plan", [{R70!r}, "--nodes", "8", "--set", "train.global_batch_size=512"])[2]
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "nemo_run")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=paths.REPO_ROOT,
                         env={"PYTHONPATH": "src:.", "PATH": "/usr/bin:/bin"}, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unknown_recipe_is_answered_from_the_files():
    registry.check_declared(R70)
    with pytest.raises(registry.UnknownRecipe, match="closest: llama3_70b_pretrain_64gpu_h100_bf16"):
        registry.check_declared("llama3_70b_pretrain_64gpu_h100_bf17")


def test_a_module_not_named_for_its_recipe_leaves_the_names_to_the_import(tmp_path, monkeypatch):
    (tmp_path / "dyn.py").write_text("from recipes._base import register\n")
    monkeypatch.setenv(registry.PATH_VAR, str(tmp_path))
    assert registry.declared_nodes() is None
    assert registry.check_declared("made_at_import_time") is None  # unknowable before the import: no early error
    # A file named for its recipe (what make new-recipe writes) declares that name, and its nodes by the name's GPU
    # count: now the files know every name, and an unknown one is an early error, so the pass above is dyn.py's doing.
    (tmp_path / "dyn.py").rename(tmp_path / "declared_pretrain_16gpu_h100_bf16.py")
    assert registry.declared_nodes()["declared_pretrain_16gpu_h100_bf16"] == 2
    assert registry.check_declared("declared_pretrain_16gpu_h100_bf16") is None
    with pytest.raises(registry.UnknownRecipe):
        registry.check_declared("made_at_import_time")


def test_an_override_bridge_replaces_is_an_error_naming_the_winner():
    plan = make_plan(R70, sets="ddp.bucket_size=50000000")
    (f,) = [f for f in plan.report.errors if f.code == "override_replaced"]
    assert "comm_overlap.bucket_size wins" in f.message and f.fix == "comm_overlap.bucket_size=50000000"
    assert not make_plan(R70, sets=f.fix).report.errors


def test_a_huge_bucket_on_the_losing_field_gets_a_fix_that_passes():
    plan = make_plan(R70, sets="ddp.bucket_size=1000000000000")
    (f,) = [f for f in plan.report.errors if f.code == "override_replaced"]
    assert "134,217,728" in f.message or "134217728" in f.message
    assert not make_plan(R70, sets=f.fix).report.errors


# Each SET breaks one rule whose finding carries a fix; the fix, applied on top, must clear it and add no error.
BROKEN = [
    (R70, "comm_overlap.bucket_size=1000000000000"),
    (R70, "comm_overlap.bucket_size=2000000000"),
    (R70, "comm_overlap.bucket_size=900000000"),
    (R70, "comm_overlap.tp_comm_overlap=false"),
    (R70, "comm_overlap.overlap_grad_reduce=false"),
    (R70, "comm_overlap.overlap_param_gather=false"),
    (R70, "comm_overlap.overlap_p2p_comm=false"),
    (R70, "model.sequence_parallel=false"),
    (R70, "mixed_precision.fp8_param_gather=true"),
    (R70, "train.global_batch_size=255"),
    (R70, "ddp.bucket_size=50000000"),
    ("llama3_8b_pretrain_8gpu_h100_bf16", "model.virtual_pipeline_model_parallel_size=2"),
]


@pytest.mark.parametrize(("recipe", "sets"), BROKEN, ids=[s for _, s in BROKEN])
def test_every_suggested_fix_passes_when_applied(recipe, sets):
    broken = make_plan(recipe, sets=sets).report.errors
    fixable = [f for f in broken if f.fix]
    assert fixable, f"{sets}: no finding with a fix among {[f.code for f in broken]}"
    for f in fixable:
        after = make_plan(recipe, sets=f"{sets} {f.fix}").report
        assert f.code not in after.codes("error"), f"{f.fix} did not clear {f.code}"
        assert after.codes("error") <= {g.code for g in broken} - {f.code}, f"{f.fix} raised {after.codes('error')}"


# --- round three: numbers whatever the field, signs, keys, rules across fields ---------------------------------------


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        ("optimizer.lr=1.0e+400", "not a finite number"),  # YAML reads it as inf
        ("optimizer.lr=1e400", "not a finite number"),  # and this as a string, read as Python would: inf
        ("optimizer.lr=.inf", "not a finite number"),
        ("optimizer.lr=-.inf", "not a finite number"),
        ("model.init_method_std=.nan", "not a finite number"),
        ("optimizer.lr=1" + "0" * 400, "beyond the 64-bit integers"),  # an integer past int64, in a float field
        ("train.train_iters=9223372036854775808", "beyond the 64-bit integers"),
        ("optimizer.lr=0", "optimizer.lr=0.0: must be > 0"),
        ("optimizer.lr=-1.0", "must be > 0 (the step size"),
        ("optimizer.min_lr=-1.0e-5", "optimizer.min_lr=-1e-05: must be ≥ 0"),
        ("optimizer.weight_decay=-0.1", "must be ≥ 0 (a negative decay grows the weights)"),
        ("optimizer.adam_eps=0", "must be > 0 (Adam divides"),
        ("model.moe_router_topk=0", "model.moe_router_topk=0: must be a whole number ≥ 1"),
        ("train.train_iters=5 train.train_iters=6", "train.train_iters is set twice in SET"),
        ("overlap.tp_preset=a overlap.tp_preset=b", "overlap.tp_preset is set twice in SET"),
        ("model.some_list=[1,1" + "0" * 400 + "]", "beyond the 64-bit integers"),  # any key's value is read early
    ],
)
def test_numbers_signs_and_keys_are_refused_before_the_import(sets, needle):
    with pytest.raises(OverrideError, match=re.escape(needle)) as exc:
        inputs.check_sets(sets)
    assert "\n" not in str(exc.value)


def test_values_each_rule_allows_pass():
    ok = "optimizer.lr=3e-4 optimizer.min_lr=0 optimizer.clip_grad=0 model.moe_router_topk=8 "
    assert inputs.check_sets(ok + "train.train_iters=9223372036854775807 comm_overlap.tp_comm_overlap_cfg.x=1")
    assert overrides.number_problem(float(2**63)) is None and overrides.number_problem(True) is None


def test_nodes_beyond_any_cluster_and_non_ascii_digits_are_refused():
    assert inputs.parse_nodes(str(inputs.MAX_NODES)) == inputs.MAX_NODES
    for text in (str(inputs.MAX_NODES + 1), "99999999999999999999", "８", "²"):
        with pytest.raises(ValueError, match="NODES="):
            inputs.parse_nodes(text)


@pytest.mark.parametrize(
    ("recipe", "sets", "needle"),
    [
        (R70, "train.train_iters=null", "one of train.train_iters, train.train_samples, train.num_epochs"),
        (R70, "model.hidden_size=8200", "hidden 8200 is not divisible by heads 64 (head dim)"),
        (R70, "model.num_attention_heads=60", "hidden 8192 is not divisible by heads 60"),
        (Q30, "model.num_moe_experts=null", "this recipe is a mixture of 128 experts"),
        (Q30, "model.moe_router_topk=129", "model.moe_router_topk=129: more than the 128 experts; use 1..128"),
        (Q30, "model.num_moe_experts=4", "model.moe_router_topk=8: more than the 4 experts"),
    ],
)
def test_rules_across_fields_are_checked_on_the_built_config(recipe, sets, needle):
    cfg = registry.get(recipe).build()
    facts = inputs.recipe_facts(cfg)
    pairs = overrides.parse(sets)
    overrides.apply(cfg, pairs)
    assert any(needle in p for p in inputs.config_problems(cfg, facts, [k for k, _ in pairs]))


@pytest.mark.parametrize(
    ("recipe", "sets"),
    [
        (R70, "model.hidden_size=8192 model.num_attention_heads=32"),  # divides: 256-wide heads
        (R70, "model.hidden_size=8200 model.kv_channels=128"),  # a head dim of its own, said explicitly
        (Q30, "model.hidden_size=2050"),  # Qwen3's head dim is its own (128 on 2048 / 32): no division
        (Q30, "model.moe_router_topk=128"),
    ],
)
def test_what_the_rules_across_fields_allow(recipe, sets):
    cfg = registry.get(recipe).build()
    facts = inputs.recipe_facts(cfg)
    pairs = overrides.parse(sets)
    overrides.apply(cfg, pairs)
    assert inputs.config_problems(cfg, facts, [k for k, _ in pairs]) == []


def test_every_recipe_declares_its_nodes_in_its_file():
    """What make submit's partition check reads before the import is what the registry holds after it."""
    declared = registry.declared_nodes()
    assert {n: declared[n] for n in registry.names()} == {n: registry.get(n).nodes for n in registry.names()}


def test_a_plan_beyond_the_gpus_memory_is_an_audit_error_and_one_inside_the_margin_a_warning(planned):
    over = make_plan(R8, sets="model.seq_length=1048576 dataset.seq_length=1048576")
    assert over.memory.over_hbm and "memory_does_not_fit" in over.report.codes("error") and not over.report.ok
    assert "does NOT fit" in over.memory.summary()
    est = planned(R8).memory
    assert est.fits and build.memory_findings(est) == []
    tight = dataclasses.replace(est, reserve_gb=est.reserve_gb + est.headroom_gb + est.margin_gb / 2)
    assert not tight.fits and not tight.over_hbm and "fits only inside the 4 GB margin" in tight.summary()
    assert [(f.level, f.code) for f in build.memory_findings(tight)] == [("warning", "memory_tight")]
