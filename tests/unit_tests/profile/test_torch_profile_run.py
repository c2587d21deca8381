"""TORCH_PROFILE=<start>:<end>: the PyTorch profiler on a run, like NSYS. The option typed and checked, the job's
profiler config (Bridge's ProfilingConfig, rebuilt as launch/entry.py rebuilds it from the run directory), and
what the job leaves after training: each profiled rank's trace copied from where Bridge writes it into
<run dir>/torch_profile/, the report and timeline the first profiled rank writes, the marker every rank waits for.
No GPU here: the trace is a real one from tests/data/reference_traces, put where Bridge would have written it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest
from reference_traces import traces_dir

from overlapkit.bridge import submission
from overlapkit.cluster.profiles import load_profile
from overlapkit.nightly import exposed
from overlapkit.profile import overlap_report, profiled
from overlapkit.spec import runopts
from overlapkit.spec.runopts import TORCH_DIR

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def test_the_option_is_typed_like_nsys():
    opts = runopts.parse(torch_profile="10:12", torch_profile_ranks="4,0")
    assert opts.torch_profile == (10, 12) and opts.torch_profile_ranks == (0, 4) and opts.nsys is None
    assert opts.window == ("TORCH_PROFILE", (10, 12), (0, 4))
    assert runopts.RunOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts  # as overrides.json holds it
    for kw, msg in (
        ({"torch_profile": "12:10"}, "TORCH_PROFILE='12:10': use <start>:<end>"),
        ({"torch_profile_ranks": "0"}, "TORCH_PROFILE_RANKS= without TORCH_PROFILE="),
        ({"torch_profile": "1:2", "torch_profile_ranks": "a"}, "TORCH_PROFILE_RANKS='a'"),
        ({"torch_profile": "1:2", "nsys": "1:2"}, "NSYS= and TORCH_PROFILE= together"),
    ):
        with pytest.raises(ValueError, match=msg):
            runopts.parse(**kw)


def test_the_job_runs_bridges_pytorch_profiler_on_the_window(tmp_path):
    """submit.prepare on the local cluster's profile, then the config the job rebuilds from the run directory."""
    from launch import entry
    from overlapkit.cluster import submit

    prof = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    opts = runopts.RunOptions(torch_profile=(3, 5), torch_profile_ranks=(0, 4))
    sub = submission.prepare(R8, prof, preflight_only=True, caller_env={}, run=opts)
    plan = json.loads((sub.run_dir / "plan.json").read_text())
    assert plan["run"]["torch_profile"] == {"steps": [3, 5], "ranks": [0, 4]} and plan["run"]["nsys"] is None
    cfg = entry.rebuild(entry._args(submit.entry_args(sub.plan, sub.run_dir, True, "full"))).cfg
    p = cfg.profiling
    assert p.use_pytorch_profiler and not p.use_nsys_profiler
    assert (p.profile_step_start, p.profile_step_end, p.profile_ranks) == (3, 5, [0, 4])
    with pytest.raises(ValueError, match=r"TORCH_PROFILE_RANKS=0,9: rank 9 is beyond the run's 8 ranks"):
        from overlapkit.bridge.build import make_plan

        make_plan(R8, run=runopts.RunOptions(torch_profile=(3, 5), torch_profile_ranks=(0, 9)), caller_env={})


@pytest.fixture
def torch_run(tmp_path, planned, monkeypatch):
    """A run directory of an 8-GPU plan profiled with TORCH_PROFILE on rank 0, and Bridge's trace of rank 0 where
    Bridge writes it (<tensorboard_dir>/../torch_profile/rank-0.json.gz)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = planned(R8).to_dict()
    plan["run"] = {**(plan.get("run") or {}), "torch_profile": {"steps": [3, 5], "ranks": [0]}}
    (run_dir / "plan.json").write_text(json.dumps(plan, default=str))
    tb = tmp_path / "jobs" / "tensorboard" / "p"  # Bridge's tensorboard writer made it; its trace is beside it
    tb.mkdir(parents=True)
    (tb.parent / "torch_profile").mkdir()
    shutil.copyfile(traces_dir() / "nccl_data.json.gz", tb.parent / "torch_profile" / "rank-0.json.gz")
    monkeypatch.setenv("SLURM_PROCID", "0")
    return run_dir, plan, str(tb)


def test_after_training_the_run_directory_holds_trace_report_and_marker(torch_run):
    run_dir, plan, tb = torch_run
    profiled.after_training(run_dir, plan, tb)
    assert (run_dir / TORCH_DIR / "rank-0.json.gz").read_bytes() == (traces_dir() / "nccl_data.json.gz").read_bytes()
    done = json.loads((run_dir / TORCH_DIR / profiled.DONE).read_text())
    assert done == {"missing_exports": [], "error": None}
    written = json.loads((run_dir / "overlap_report.json").read_text())
    assert written == {
        **overlap_report.report_of(overlap_report.measure(*overlap_report.run_inputs(run_dir))),
        "timeline": str(run_dir / "overlap_timeline.png"),
    }
    assert written["ranks"]["0"]["steps"] == {"source": "profiler_step", "count": 3}
    report, why = exposed.read(run_dir)  # what the nightly reads
    assert why is None and set(exposed.shares(report)) == {"dp"}


def test_other_ranks_hold_and_a_later_segment_does_nothing(torch_run, monkeypatch, capsys):
    run_dir, plan, tb = torch_run
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setattr(profiled, "hold", lambda d, where: (d, where))
    calls = []
    monkeypatch.setattr(profiled, "write_report", lambda *a, **k: calls.append((a, k)))
    profiled.after_training(run_dir, plan, tb)  # rank 3: not profiled, waits for the marker
    assert calls == [] and not (run_dir / TORCH_DIR / "rank-3.json.gz").exists()
    monkeypatch.setenv("SLURM_PROCID", "0")
    (run_dir / TORCH_DIR).mkdir()
    (run_dir / TORCH_DIR / "rank-0.json.gz").write_bytes(b"kept")
    (run_dir / TORCH_DIR / profiled.DONE).write_text("{}")
    profiled.after_training(run_dir, plan, tb)  # a later segment: the window was profiled and reported already
    assert calls == [] and (run_dir / TORCH_DIR / "rank-0.json.gz").read_bytes() == b"kept"


def test_a_missing_trace_is_one_line_and_the_report_still_says_so(torch_run, capsys, monkeypatch):
    run_dir, plan, tb = torch_run
    (profile_dir := run_dir.parent / "jobs" / "tensorboard" / "torch_profile" / "rank-0.json.gz").unlink()
    monkeypatch.setattr(profiled, "write_report", lambda d, r, failed, where: REAL_WRITE(d, r, 5, failed, where))
    profiled.after_training(run_dir, plan, tb)
    err = capsys.readouterr().err
    assert f"the PyTorch profiler wrote no {profile_dir.parent.parent / 'p/../torch_profile/rank-0.json.gz'}" in err
    done = json.loads((run_dir / TORCH_DIR / profiled.DONE).read_text())
    assert done["missing_exports"] == ["rank-0.json.gz"] and done["error"]


def test_an_earlier_runs_trace_is_never_reported_as_this_ones(torch_run, capsys, monkeypatch):
    """Bridge writes beside the TensorBoard directory, shared by every run that logs there: a trace older than this
    training (an earlier run's, this one having stopped before its window) is one line, not kept."""
    run_dir, plan, tb = torch_run
    src = run_dir.parent / "jobs" / "tensorboard" / "torch_profile" / "rank-0.json.gz"
    os.utime(src, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setattr(profiled, "write_report", lambda d, r, failed, where: REAL_WRITE(d, r, 5, failed, where))
    profiled.after_training(run_dir, plan, tb, since=time.time() - 60)
    assert "predates this job's training: an earlier run's trace, not kept" in capsys.readouterr().err
    assert not (run_dir / TORCH_DIR / "rank-0.json.gz").exists() and not (run_dir / "overlap_report.json").exists()
    assert json.loads((run_dir / TORCH_DIR / profiled.DONE).read_text())["missing_exports"] == ["rank-0.json.gz"]


REAL_WRITE = profiled.write_report
