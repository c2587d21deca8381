"""RUN_NAME, SEGMENTS and NSYS on real plans: where checkpoints and logs go, the guards a chained run gets, what the
audit refuses (the resume guard on checkpoint directories: cluster/test_resume.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from overlapkit.bridge import submission
from overlapkit.bridge.build import make_plan
from overlapkit.bridge.runopts import lines as run_lines
from overlapkit.cluster.profiles import load_profile
from overlapkit.spec import runopts
from overlapkit.spec.request import PlanRequest

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def bound(tmp_path, profile=None, **kw):
    profile = profile or dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    return submission.bind(PlanRequest(R8, run=runopts.RunOptions(**kw)), profile).run, profile


def test_run_name_puts_checkpoints_and_tensorboard_under_the_shared_job_dir(tmp_path):
    opts, profile = bound(tmp_path, run_name="llama-a", segments=3)
    plan = make_plan(R8, run=opts, cluster=profile.resolved(laid_out=True))
    ck, jobs = plan.cfg.checkpoint, tmp_path / "jobs"
    assert ck.save == ck.load == str(jobs / "checkpoints" / "llama-a")
    assert plan.cfg.logger.tensorboard_dir == str(jobs / "tensorboard" / "llama-a")
    assert plan.cfg.train.exit_signal_handler and plan.cfg.train.exit_duration_in_mins == 30 - runopts.GUARD_MIN
    assert not ck.async_save and plan.report.ok  # synchronous save: no nvidia-resiliency-ext needed
    run = plan.to_dict()["run"]
    assert run["save_interval"] == 500 and run["signal"] == f"TERM@{runopts.PREEMPT_S}" and run["segments"] == 3
    lines = run_lines(plan.to_dict())
    assert any(
        line.startswith(f"checkpoints: {ck.save} every 500 iterations; a crash loses up to 500") for line in lines
    )


def test_without_run_name_a_run_is_a_benchmark_with_no_checkpoints():
    plan = make_plan(R8)
    assert plan.cfg.checkpoint.save is None and plan.cfg.checkpoint.load is None
    assert "nemo_experiments" not in json.dumps(plan.to_dict()["run"])
    assert run_lines(plan.to_dict())[-1].startswith("checkpoints: off (benchmark)")


def test_crash_loss_uses_the_plans_predicted_step_time(tmp_path):
    opts, profile = bound(tmp_path, run_name="x")
    plan = make_plan("llama3_8b_pretrain_8gpu_h100_fp8cs", run=opts, cluster=profile.resolved(laid_out=True))
    run, step = plan.to_dict()["run"], plan.throughput.step_s  # sizing/throughput.py's prediction
    assert run["expected_step_s"] == round(step, 2) and run["crash_loss_min"] == round(step * 500 / 60, 1)
    assert "at the predicted step time" in run_lines(plan.to_dict())[-3]


@pytest.mark.parametrize(
    ("sets", "code", "level"),
    [
        ("checkpoint.save=/somewhere/else", "checkpoint_outside_job_dir", "error"),
        ("checkpoint.save=null", "segments_without_checkpoints", "error"),
        ("checkpoint.async_save=true checkpoint.async_strategy=nvrx", "async_save_needs_nvrx", "warning"),
        ("checkpoint.save_interval=null", "no_save_interval", "warning"),
    ],
)
def test_the_audit_names_checkpoint_settings_that_lose_work(tmp_path, sets, code, level):
    opts, profile = bound(tmp_path, run_name="x", segments=2)
    plan = make_plan(R8, run=opts, cluster=profile.resolved(laid_out=True), sets=sets)
    assert code in plan.report.codes(level)


def test_wandb_comes_from_the_profile_and_its_key_must_be_a_secret_by_name(tmp_path):
    base = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path), wandb_project="pretrain")
    opts, _ = bound(tmp_path, base, run_name="r1")
    plan = make_plan(R8, run=opts, cluster=base.resolved(laid_out=True))
    assert (plan.cfg.logger.wandb_project, plan.cfg.logger.wandb_exp_name) == ("pretrain", "r1")
    assert "wandb_key_not_secret" in plan.report.codes("error")
    keyed = dataclasses.replace(base, secrets=("WANDB_API_KEY",))
    assert (
        "wandb_key_not_secret"
        not in make_plan(R8, run=opts, cluster=keyed.resolved(laid_out=True), caller_env={}).report.codes()
    )


def test_nsys_sets_bridges_profiling_window_and_ranks():
    plan = make_plan(R8, run=runopts.RunOptions(nsys=(10, 12), nsys_ranks=(0, 4)))
    p = plan.cfg.profiling
    assert p.use_nsys_profiler and (p.profile_step_start, p.profile_step_end, p.profile_ranks) == (10, 12, [0, 4])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("a b",), "RUN_NAME='a b'"),
        (("../up",), "RUN_NAME='../up'"),
        (("", "2"), "SEGMENTS=2 needs RUN_NAME"),
        (("x", "0"), "SEGMENTS='0'"),
        (("x", "101"), "SEGMENTS='101'"),
        (("x", "1", "12"), "NSYS='12'"),
        (("x", "1", "12:10"), "start < end"),
        (("x", "1", "10:12", "a"), "NSYS_RANKS='a'"),
        (("x", "1", "", "0"), "NSYS_RANKS= without NSYS"),
        (("x", "²"), "SEGMENTS='²'"),  # str.isdigit takes it, int() does not: a traceback before
        (("x", "２"), "SEGMENTS='２'"),  # a full-width digit int() would read as 2
        (("x", "1", "1:99999999999999999999"), "iterations are at most 9,223,372,036,854,775,807"),
        (("x", "1", "１:５"), "NSYS='１:５'"),
        (("x", "1", "-1:5"), "NSYS='-1:5': use <start>:<end>"),
        (("x", "1", "10:12", "0,８"), "NSYS_RANKS='0,８'"),
        (("ｘ",), "RUN_NAME='ｘ'"),
    ],
)
def test_bad_run_options_are_one_line(args, message):
    with pytest.raises(ValueError, match=None) as err:
        runopts.parse(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_time_limit_too_short_for_the_save_window_is_refused(tmp_path):
    profile = dataclasses.replace(load_profile("local"), time_limit="00:15:00", job_dir=str(tmp_path))
    with pytest.raises(ValueError, match="SEGMENTS needs a time limit above 20 minutes"):
        submission.bind(PlanRequest(R8, run=runopts.RunOptions(run_name="x", segments=2)), profile)


def test_the_nsys_window_is_checked_against_the_run_it_profiles():
    opts = runopts.parse(nsys="10:12", nsys_ranks="0,7")
    assert runopts.nsys_problem(opts, train_iters=12, world=8) is None
    assert "the run ends at iteration 11 (train.train_iters): use an end ≤ 11" in runopts.nsys_problem(opts, 11, 8)
    assert runopts.nsys_problem(opts, 100, 4) == ("NSYS_RANKS=0,7: rank 7 is beyond the run's 4 ranks: use ranks 0..3")
    with pytest.raises(ValueError, match="NSYS=10:20: the run ends at iteration 15"):
        make_plan(R8, sets="train.train_iters=15", run=runopts.parse(nsys="10:20"))
