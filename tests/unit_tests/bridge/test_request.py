"""The request a plan is made from: parsed once (every pre-import check, in order), bound once to a profile by the
cluster stage, and carried unchanged into the plan, its overrides.json and the job's rebuild."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launch import entry
from launch import plan as plan_cli
from launch.args import request_of
from overlapkit import paths
from overlapkit.bridge import request, submission
from overlapkit.bridge.build import overrides_record, plan_for, write_run_dir
from overlapkit.cluster import submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput
from overlapkit.spec import runopts
from overlapkit.spec.request import PlanRequest
from overlapkit.spec.runopts import OVERRIDES

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def test_parse_types_the_whole_request():
    req = request.parse(R8, "2", "train.global_batch_size=64 'logger.wandb_exp_name=a b'", {"run_name": "r"})
    assert req == PlanRequest(
        R8, 2, (("train.global_batch_size", "64"), ("logger.wandb_exp_name", "a b")), runopts.RunOptions("r")
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.nodes = 3
    assert request.parse("", listing=True) == PlanRequest("")  # make recipes names no recipe


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nope", "0", "bad", {"segments": "2"}), "NODES='0'"),  # NODES first
        (("", "1", "bad", {"segments": "2"}), "no recipe given: make plan RECIPE="),
        ((R8, "1", "bad", {"segments": "2"}), "override 'bad' is not KEY=VALUE"),
        ((R8, "1", "", {"segments": "2"}), "SEGMENTS=2 needs RUN_NAME"),  # the run options last
    ],
)
def test_parse_checks_in_the_order_the_entries_always_did(args, message):
    with pytest.raises((KeyError, ValueError)) as err:
        request.parse(*args)
    assert message in str(err.value)


def test_the_launch_entry_is_the_same_parse():
    args = plan_cli.parse(
        [R8, "--nodes", "4", "--set", "train.global_batch_size=64", "--run-name", "x", "--nsys", "10:12"]
    )
    req = request_of(args)
    assert req.nodes == 4
    assert req.run == request.parse(R8, run={"run_name": "x", "nsys": "10:12"}).run


def test_bind_fills_the_profile_in_once(tmp_path):
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    req = request.parse(R8, "", "", {"run_name": "a", "segments": "2"})
    bound = submission.bind(req, profile)
    assert (bound.recipe, bound.nodes, bound.sets) == (req.recipe, req.nodes, req.sets)
    assert bound.run.job_dir == str(tmp_path / "jobs") and bound.run.time_limit_min == 30
    assert bound.run.checkpoint_dir == str(tmp_path / "jobs" / "checkpoints" / "a")
    local = submit.bind_local(req)
    assert (
        local.nodes == 1 and local.run.job_dir == str(paths.runs_root() / "local") and local.run.time_limit_min is None
    )


def test_make_plan_resolves_clusters_profile_in_its_entry_and_plan_for_binds_it(tmp_path):
    """CLUSTER's profile is read once, before the Bridge import, into plain values (the job directory absolute) that
    plan/ binds with the recipe's time limit: a relative job_dir is under the checkout, runs/... under runs_root()
    (the checkout's runs/, or OVERLAPKIT_RUNS: the suite's own folder)."""
    site = tmp_path / "site.toml"
    site.write_text('account = "a"\npartition = "p"\njob_dir = "runs/elsewhere"\ntime_limit = "00:45:00"\n')
    args = plan_cli.parse([R8, "--cluster", str(site), "--run-name", "a", "--segments", "2"])
    plan_cli.check(args)
    where = args.request.cluster
    assert (where.name, where.job_path, where.time_limit) == (
        "site",
        str(paths.runs_root() / "elsewhere"),
        "00:45:00",
    )
    run = plan_for(args.request).run
    assert run.checkpoint_dir == str(paths.runs_root() / "elsewhere/checkpoints/a") and run.time_limit_min == 45
    site.write_text('account = "a"\npartition = "p"\ntime_limit = "00:20:00"\n')  # no room for the save window
    plan_cli.check(args)
    with pytest.raises(BadInput, match=r"^SEGMENTS needs a time limit above 20 minutes \(the save window\): .*site"):
        plan_for(args.request)


def test_the_job_rebuilds_the_request_that_was_planned(tmp_path):
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    req = submission.bind(request.parse(R8, "", "train.train_iters=9", {"run_name": "a", "nsys": "3:5"}), profile)
    laid = dataclasses.replace(req, cluster=profile.resolved(laid_out=True))
    plan = plan_for(laid, caller_env={})
    assert plan.request == laid and plan.run == req.run  # bound again: the same
    run_dir = write_run_dir(plan, tmp_path / "runs")
    rec = json.loads((run_dir / OVERRIDES).read_text())
    assert rec["set"] == overrides_record(plan)["set"] == [["train.train_iters", "9"]]
    again = request.from_record(rec, R8, None)
    assert again == req  # bound at submit: the job never binds again
    args = entry._args(["--recipe", R8, "--run-dir", str(run_dir), "train.train_iters=11"])
    rebuilt = entry.rebuild(args)
    assert rebuilt.request == dataclasses.replace(req, sets=(*req.sets, ("train.train_iters", "11")))
    assert rebuilt.cfg.train.train_iters == 11 and rebuilt.cfg.checkpoint.save == req.run.checkpoint_dir


def test_gpu_is_parsed_once_and_travels_to_the_job():
    assert request.parse(R8).gpu == "h100" and request.parse(R8, gpu="H200").gpu == "h200"
    with pytest.raises(BadInput, match=r"^GPU=b200: not a GPU the models know; use one of h100, h200"):
        request.parse(R8, gpu="b200")
    assert request.loose(R8, gpu="h200").gpu == "h200"
    args = plan_cli.parse([R8, "--gpu", "h200"])
    assert request_of(args).gpu == "h200"
    assert request.from_record({"set": [], "run": {}, "gpu": "h200"}, R8, None).gpu == "h200"
    assert request.from_record({"set": [], "run": {}}, R8, None).gpu == "h100"  # a record from before GPU=
