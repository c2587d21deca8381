"""The resume guard every segment runs (launch/entry.py) and make submit asks first, on checkpoint directories laid
out as Megatron writes them (ckpt_fixtures.py): a later segment without a tracker, a tracker naming an incomplete
iteration (fallback with checkpoint.ckpt_step, or a stop), a finished run, and a layout changed since the save."""

from __future__ import annotations

import dataclasses
import json

import pytest
from ckpt_fixtures import save_iteration

from launch import entry
from overlapkit.bridge import submission
from overlapkit.cluster import resume, submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.spec import runopts
from overlapkit.spec.request import PlanRequest

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
LAYOUT = {"nodes": 1, "gpus": 8, "tp": 1, "pp": 1, "vpp": None, "cp": 1, "dp": 8, "gbs": 128, "seq": 8192}


def _guard(tmp_path, segment, train_iters=100, layout=LAYOUT, **run):
    plan = {"run": {"checkpoint_dir": str(tmp_path / "ck"), "train_iters": train_iters, **run}, "layout": layout}
    args = entry._args(["--recipe", R8, "--run-dir", str(tmp_path), "--segment", str(segment), "--segments", "3"])
    return entry.resume_guard(args, plan), args


def test_a_later_segment_without_a_checkpoint_fails_loudly(tmp_path, capsys):
    assert _guard(tmp_path, 1)[0] is None  # the first segment may start fresh
    assert _guard(tmp_path, 2)[0] == 1
    err = capsys.readouterr().err
    assert "segment 2/3: no checkpoint to resume from" in err and "refusing to start from iteration 0" in err
    save_iteration(tmp_path / "ck", 40, tracker=False)  # an iteration directory without a tracker is not a checkpoint
    assert _guard(tmp_path, 2)[0] == 1


def test_only_rank_0_fails_the_segment_so_that_its_reason_is_printed(tmp_path, capsys, monkeypatch):
    """srun --kill-on-bad-exit cancels the step at the first non-zero exit: a silent rank exiting 1 first once killed
    rank 0 before it printed why (the job's log said only CANCELLED). The others exit 0; rank 0's 1 fails the job."""
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert _guard(tmp_path, 2)[0] == 0 and capsys.readouterr().err == ""
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert _guard(tmp_path, 2)[0] == 1 and "segment 2/3: no checkpoint to resume from" in capsys.readouterr().err


def test_a_later_segment_resumes_and_one_after_the_end_exits_zero(tmp_path, capsys):
    save_iteration(tmp_path / "ck", 40)
    code, args = _guard(tmp_path, 2)
    assert code is None and args.resume == 40 and args.ckpt_step is None
    assert "resuming from iteration 40" in capsys.readouterr().out
    save_iteration(tmp_path / "ck", 100)
    assert _guard(tmp_path, 3)[0] == 0 and "training finished at iteration 100" in capsys.readouterr().out
    # a run directory with no recorded jobs: nothing to cancel, nothing said


@pytest.mark.parametrize("lost", [".metadata", "metadata.json", "run_config.yaml", "train_state.pt"])
def test_an_incomplete_tracked_iteration_falls_back_to_the_last_complete_one(tmp_path, capsys, lost):
    ck = tmp_path / "ck"
    save_iteration(ck, 40)
    save_iteration(ck, 60, lacking=(lost,))  # the tracker names 60, but its save never finished
    code, args = _guard(tmp_path, 2)
    assert code is None and args.ckpt_step == 40 and args.resume == 40  # Bridge loads 40, not the tracker's 60
    out = capsys.readouterr().out
    assert f"warning: segment 2/3: iteration 60 in {ck} is incomplete (missing {lost})" in out
    assert "resuming from iteration 40, the last complete one (checkpoint.ckpt_step=40)" in out


def test_an_incomplete_iteration_with_none_before_it_stops_and_a_cut_save_above_is_named(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_iteration(ck, 60, lacking=(".metadata",))
    assert _guard(tmp_path, 2)[0] == 1
    err = capsys.readouterr().err
    assert "the tracker names iteration 60" in err and "no complete iteration precedes it" in err
    assert len(err.strip().splitlines()) == 1
    save_iteration(ck, 40)
    save_iteration(ck, 60)
    save_iteration(ck, 80, lacking=("metadata.json", "train_state.pt", "run_config.yaml"), tracker=False)
    (ck / resume.TRACKERS[1]).write_text("60")  # a kill mid-save of 80: the trackers still name 60
    assert _guard(tmp_path, 2)[0] is None
    out = capsys.readouterr().out
    assert "iter_0000080 is a save cut short (missing metadata.json, train_state.pt, run_config.yaml)" in out
    assert "resuming from iteration 60" in out


def test_a_changed_layout_is_refused_unless_only_the_weights_are_loaded(tmp_path, capsys):
    ck = tmp_path / "ck"
    resume.record_layout(str(ck), LAYOUT, None, "11")  # the first run started fresh, then saved 40
    save_iteration(ck, 40)
    assert _guard(tmp_path, 2)[0] is None
    capsys.readouterr()
    wider = {**LAYOUT, "nodes": 2, "gpus": 16, "dp": 16}
    assert _guard(tmp_path, 2, layout=wider)[0] == 1
    err = capsys.readouterr().err.strip()
    assert "iteration 40 in" in err and "nodes 1→2, gpus 8→16, dp 8→16" in err
    assert "SET='checkpoint.load_optim=false'" in err and len(err.splitlines()) == 1
    assert _guard(tmp_path, 2, layout={**LAYOUT, "gbs": 256}, load_optim=False)[0] is None  # opted in
    assert _guard(tmp_path, 2, layout={**LAYOUT, "tp": 2}, finetune=True)[0] is None
    # the wider run started at 40 and saved 50: 50 is its layout's, 40 still the first's
    resume.record_layout(str(ck), wider, 40, "12")
    resume.record_layout(str(ck), wider, 45, "13")  # its next segment: the same layout, nothing new to record
    save_iteration(ck, 50)
    assert resume.layout_problem(str(ck), 50, wider, {}) is None  # saved by the wider run
    assert "nodes 1→2" in resume.layout_problem(str(ck), 40, wider, {})  # saved by the first
    assert [e["slurm_job_id"] for e in json.loads((ck / resume.LAYOUTS).read_text())] == ["11", "12"]


def test_make_submit_refuses_a_changed_layout_before_anything_is_queued(tmp_path, capsys):
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    req = submission.bind(PlanRequest(R8, nodes=2, run=runopts.RunOptions(run_name="grow")), profile)
    req = dataclasses.replace(req, cluster=profile.resolved(laid_out=True))
    from overlapkit.bridge.build import plan_for

    plan = plan_for(req)
    ck = tmp_path / "jobs" / "checkpoints" / "grow"
    resume.record_layout(str(ck), {**plan.layout, "nodes": 1, "gpus": 8, "dp": plan.layout["dp"] // 2}, None, "7")
    save_iteration(ck, 500)
    with pytest.raises(submit.SubmitError, match=r"RUN_NAME=grow: iteration 500 in .*\(nodes 1→2.*nothing submitted"):
        submit.resume_lines(plan)
    ok = plan_for(dataclasses.replace(req, sets=(("checkpoint.load_optim", "false"),)))
    assert submit.resume_lines(ok) == [f"RUN_NAME=grow: resuming from iteration 500 in {ck}"]
