"""The make watcher's parts on their own: who is alive (a zombie is not), whose ancestor make is. Its effect, a
child of a killed make stopping, is tested where it matters: tests/unit_tests/cluster/test_sbatch.py (a submission)
and tests/e2e/test_prep_data_orphan_e2e.py (make prep-data publishes nothing)."""

from __future__ import annotations

import os
import subprocess
import time

from overlapkit import makewatch


def test_alive_is_false_for_a_dead_pid_a_zombie_and_pids_that_name_a_group():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert makewatch.alive(child.pid) and makewatch.alive(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while (makewatch.proc_stat(child.pid) or ["Z"])[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not makewatch.alive(child.pid)  # killed, not yet reaped: a zombie
    finally:
        child.wait()
    assert not makewatch.alive(child.pid)
    assert not makewatch.alive(0) and not makewatch.alive(-1) and not makewatch.alive(2**70)


def test_is_ancestor_walks_up_the_parents():
    assert makewatch.is_ancestor(os.getppid()) and makewatch.is_ancestor(1)
    assert not makewatch.is_ancestor(os.getpid())
