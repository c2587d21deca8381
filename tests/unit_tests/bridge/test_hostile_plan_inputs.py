"""What a plan takes from the user, answered as what will run: null, false or 0 given to a text field is refused
(never the text "null", "false", "0" with the audit saying OK); a size no model has (LAYERS=999999999999) is refused
before a search walks it; a SET that Bridge's PreemptionPlugin overrides in the job is refused, and the plan records
the values the job runs; a checkpoint path that is a file or a link loop is an audit error, not a traceback; a
secret the profile lists but the shell does not export stops the submission before sbatch; an error carrying a
newline or a terminal escape stays one line."""

from __future__ import annotations

import dataclasses
import re

import pytest

from overlapkit.bridge import inputs, overrides, registry, submission
from overlapkit.bridge.build import make_plan
from overlapkit.bridge.overrides import OverrideError
from overlapkit.cluster import submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import one_line
from overlapkit.fork import layout_search
from overlapkit.spec import runopts
from overlapkit.spec.request import PlanRequest
from overlapkit.spec.shape import ModelShape

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


@pytest.mark.parametrize(
    "sets, read_as",
    [
        ("optimizer.optimizer=false", "true or false"),
        ("model.normalization=0", "an integer"),
        ("model.normalization=null", "null"),
        ("optimizer.optimizer=1.5", "a number"),
        ("checkpoint.ckpt_format=true", "true or false"),
    ],
)
def test_null_false_or_a_number_is_never_the_text_of_a_text_field(sets, read_as):
    key, _, raw = sets.partition("=")
    with pytest.raises(OverrideError) as exc:  # the field's annotation, after the import (Bridge's override path)
        overrides.apply(registry.get(R8).build(), overrides.parse(sets))
    msg = str(exc.value)
    assert msg.startswith(f"{key}={raw!r}: expected a string") and f"not {read_as};" in msg
    assert msg.endswith(f"""to mean the text, quote it inside SET: {key}="'{raw}'\"""")


def test_text_a_text_field_keeps():
    # the fix the refusal names, as typed inside SET="...": shlex keeps the single quotes for YAML, which reads text
    cfg = registry.get(R8).build()
    quoted = """model.normalization="'0'" checkpoint.save=null logger.wandb_exp_name=2026-12-03"""
    for sets in (quoted, "logger.wandb_exp_name=04:00:00 dataset.split=98,1,1"):
        assert inputs.check_sets(sets)
        overrides.apply(cfg, overrides.parse(sets))
    assert (cfg.model.normalization, cfg.checkpoint.save) == ("0", None)
    assert (cfg.logger.wandb_exp_name, cfg.dataset.split) == ("04:00:00", "98,1,1")


@pytest.mark.parametrize(
    "sets, bound",
    [
        ("model.num_layers=999999999999", "≤ 2,016"),
        ("model.hidden_size=10000000", "≤ 262,144"),
        ("model.seq_length=99999999999", "≤ 2,097,152"),
        ("model.num_moe_experts=1000000", "≤ 4,096"),
    ],
)
def test_a_size_no_model_has_is_refused(sets, bound):
    with pytest.raises(OverrideError, match=re.escape(bound)):
        inputs.check_sets(sets)
    assert inputs.check_sets("model.num_layers=2016 model.hidden_size=262144")


@pytest.mark.parametrize(
    "layers, said",
    [
        ("999999999999", "LAYERS=999999999999: must be a whole number ≥ 1 and ≤ 2,016 (num_layers)"),
        ("2017", "LAYERS=2017: must be a whole number ≥ 1 and ≤ 2,016 (num_layers)"),
        # past int64 the one integer rule (jsonio.integer) refuses it as it is read, before the field's ceiling
        ("1" + "0" * 40, "100000000000000000000000… (41 digits) is past int64, larger than any size here"),
    ],
)
def test_make_new_recipe_refuses_a_depth_no_model_has_at_once(make_here, layers, said):
    code, out, err = make_here(
        "new-recipe", "FROM=llama3_8b_pretrain_8gpu_h100_bf16", "NAME=deep_pretrain_64gpu_h100_bf16", f"LAYERS={layers}"
    )
    assert code == 2 and err.count("\n") == 1
    assert said in err


def test_the_split_search_walks_divisors_not_every_depth():
    deep = ModelShape(hidden=4096, layers=2016, heads=32, query_groups=8, ffn=14336, seq=8192, vocab=128256)
    assert len(list(layout_search._splits(deep, 131072, {}))) < 20000  # every number up to 2016: millions
    shape = ModelShape(hidden=8192, layers=48, heads=64, query_groups=8, ffn=22016, seq=8192, vocab=128256)
    units = shape.pipeline_units

    def valid(splits):  # the splits the audit's divisibility rule allows (PP·VPP divides the pipeline units)
        return {(tp, pp, vpp, cp) for tp, pp, vpp, cp, *_ in splits if units % (pp * (vpp or 1)) == 0}

    brute = [  # every PP and VPP up to the units, as the search once walked them
        (tp, pp, vpp if pp > 1 else None, cp, 1, 1)
        for tp in layout_search.TPS
        for cp in layout_search.CPS
        for pp in range(1, units + 1)
        if 64 % (tp * cp * pp) == 0
        for vpp in ([None] if pp == 1 else range(2, units // pp + 1))
    ]
    assert valid(layout_search._splits(shape, 64, {})) == valid(brute)
    assert layout_search.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and layout_search.divisors(1) == [1]


def _bound(tmp_path, **kw):
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    return submission.bind(PlanRequest(R8, run=runopts.RunOptions(**kw)), profile).run, profile


def test_what_the_preemption_plugin_sets_is_what_the_plan_records(tmp_path):
    opts, profile = _bound(tmp_path, run_name="x")
    plan = make_plan(R8, run=opts, cluster=profile.resolved(laid_out=True))
    assert plan.cfg.train.exit_signal_handler is True and plan.cfg.train.exit_signal_handler_for_dataloader is False
    assert plan.to_dict()["run"]["exit_signal_handler"] is True and plan.report.ok
    for sets in ("train.exit_signal_handler=false", "train.exit_signal_handler_for_dataloader=true"):
        plan = make_plan(R8, run=opts, cluster=profile.resolved(laid_out=True), sets=sets)
        [err] = [e for e in plan.report.errors if e.code == "set_overridden_by_preemption"]
        field = sets.split("=")[0]
        assert f"{field}=" in err.message and f"drop {field} from SET, or leave RUN_NAME empty" in err.message
    assert make_plan(R8, sets="train.exit_signal_handler=false").report.ok  # a benchmark: no plugin, SET stands


@pytest.mark.parametrize("kind", ["file", "loop"])
def test_a_checkpoint_path_that_is_no_directory_is_an_audit_error(tmp_path, kind):
    opts, profile = _bound(tmp_path, run_name="x")
    ck = tmp_path / "jobs" / "checkpoints" / "x"
    ck.parent.mkdir(parents=True)
    if kind == "file":
        ck.write_text("")
    else:
        ck.symlink_to(ck)
    plan = make_plan(R8, run=opts, cluster=profile.resolved(laid_out=True))
    [err] = [e for e in plan.report.errors if e.code == "checkpoint_not_a_directory"]
    assert str(ck) in err.message and "use another RUN_NAME" in err.message


def test_a_listed_secret_not_exported_is_named_never_its_value(tmp_path):
    profile = dataclasses.replace(load_profile("local"), secrets=("HOSTILE_T_KEY", "HOSTILE_U_KEY"))
    said = submit.secrets_problem(profile, {"HOSTILE_U_KEY": "v4lue"})
    assert said.startswith("secret HOSTILE_T_KEY (listed in slurm/profiles/local.toml) is not exported")
    assert "v4lue" not in said and "HOSTILE_U_KEY" not in said
    assert "(nor HOSTILE_U_KEY)" in submit.secrets_problem(profile, {"HOSTILE_U_KEY": ""})  # empty is not exported
    assert submit.secrets_problem(profile, {"HOSTILE_T_KEY": "a", "HOSTILE_U_KEY": "b"}) is None


@pytest.mark.slurm
def test_make_submit_stops_before_sbatch_on_a_secret_not_exported(tmp_path, make_here, monkeypatch):
    toml = tmp_path / "sec.toml"
    local = (load_profile("local").path).read_text().replace("secrets = []", 'secrets = ["HOSTILE_T_KEY"]')
    toml.write_text(local.replace('job_dir = "runs/slurm"', f'job_dir = "{tmp_path / "jobs"}"'))
    monkeypatch.delenv("HOSTILE_T_KEY", raising=False)
    code, out, err = make_here("submit", f"RECIPE={R8}", f"CLUSTER={toml}", "PREFLIGHT=1")
    assert code == 2 and not out and err.count("\n") == 1
    assert "secret HOSTILE_T_KEY (listed in " in err and err.rstrip().endswith("nothing submitted")
    assert not (tmp_path / "jobs").exists()


def test_an_error_stays_one_line_whatever_the_value_holds(make_here):
    assert one_line("GPU=a\nb\x1b[2J\x07 c") == "GPU=a\\nb\\x1b[2J\\x07 c"
    code, _, err = make_here("submit", f"RECIPE={R8}", "GPU=h1\x1b[31m\n00")
    assert code == 2 and err.count("\n") == 1 and "\x1b" not in err and "GPU=" in err
