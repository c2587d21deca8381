"""A chained run's status and cancel lines, on a real run directory and checkpoint layout (job states come from the
real Slurm client: a job id it never issued reads as UNKNOWN, or, without Slurm, as UNKNOWN too)."""

from __future__ import annotations

import json

from ckpt_fixtures import save_iteration

from overlapkit.cluster import chain


def test_status_lists_every_segment_and_the_last_checkpointed_iteration(tmp_path, write_plan):
    ck = tmp_path / "ck"
    for step in (100, 200):
        save_iteration(ck, step)
    (ck / "iter_0000300").mkdir()  # a save cut short: no train_state.pt, not counted
    write_plan(tmp_path, train_iters=1000)
    (tmp_path / "segment-1").mkdir()
    (tmp_path / "segment-1" / "preflight.json").write_text(json.dumps({"ok": True}))
    info = {"job_id": "999990", "job_ids": ["999990", "999991", "999992"], "checkpoint_dir": str(ck)}
    lines = chain.status_lines(tmp_path, info)
    assert lines[0].startswith("segment 1/3: job 999990 ") and lines[0].endswith("; preflight OK")
    assert lines[2].startswith("segment 3/3: job 999992 ")
    assert lines[3] == f"checkpoints: {ck}; last checkpointed iteration 200 of 1000"
    assert chain.job_ids({"job_id": "7"}) == ["7"]  # a run submitted before chains
    save_iteration(ck, 300, lacking=(".metadata",))  # the tracker names 300, whose save never finished
    last = chain.status_lines(tmp_path, info)[3]
    assert last.endswith("iteration 300 of 1000 (incomplete: missing .metadata; a resume falls back to 200)")


def test_a_finished_run_cancels_only_the_segments_after_it(tmp_path):
    assert chain.cancel_after(tmp_path, 1) == []  # no submission recorded: nothing to cancel
    (tmp_path / chain.MARKER).write_text(json.dumps({"job_id": "999990", "job_ids": ["999990", "999991"]}))
    # a job id Slurm never issued: scancel refuses it, which is said (with the fix), not raised
    [line] = chain.cancel_after(tmp_path, 1)
    assert line.startswith("segment 2 (job 999991): ") and "999990" not in line
