"""The checkpoint directory's submit lock and live-run record, in real files and processes: a lock is exclusive, a
live holder is waited for then named, a dead holder's lock is taken over, and only Slurm's word makes a run live
(the concurrent `make submit` pair on the real local Slurm: e2e/test_segments_e2e.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from overlapkit.cluster import runlock


def test_the_lock_is_exclusive_and_released_only_by_its_holder(tmp_path):
    ck = tmp_path / "ck"
    with runlock.held(ck) as path:
        holder = json.loads(path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(runlock.LiveRun, match=r"holds .*overlapkit-submit.lock \(pid \d+ on .*: wait for it"):
            with runlock.held(ck, wait_s=0.3, poll=0.1):
                pass
        assert path.is_file()  # the refused one did not remove the holder's lock
    assert not path.exists()


def test_a_dead_submitters_lock_is_taken_over(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {"host": socket.gethostname(), "pid": int(gone.stdout), "at": "2026-12-02T00:00:00+00:00"}
    (ck / runlock.LOCK).write_text(json.dumps(dead))  # kill -9 mid-submission leaves this behind
    with runlock.held(ck, wait_s=1) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    other = {**dead, "host": "login-2", "pid": 1}  # another host: its pid cannot be asked; age decides
    (ck / runlock.LOCK).write_text(json.dumps(other))
    assert not runlock.stale(ck / runlock.LOCK, other)
    os.utime(ck / runlock.LOCK, (1, 1))
    assert runlock.stale(ck / runlock.LOCK, other)


def test_only_slurms_word_makes_a_recorded_run_live(tmp_path):
    ck = tmp_path / "ck"
    assert runlock.live_problem(ck, "a") is None  # nothing recorded
    runlock.record(ck, tmp_path / "run-1", ["999990", "999991"])  # ids Slurm never issued (or long forgot)
    assert [s["job_ids"] for s in runlock.submissions(ck)] == [["999990", "999991"]]
    assert runlock.live_problem(ck, "a") is None
