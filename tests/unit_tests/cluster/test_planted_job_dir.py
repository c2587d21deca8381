"""A shared job directory with something planted in it by a co-user (a FIFO, a socket, a device, a directory or junk
where a run's submission.json or a job's log should be): `make status|cancel|logs` never hang on it (hostile sweep 5,
R011/R012/R026); the planted record is passed over with its reason on stderr and the latest readable run is shown,
a planted log is said in its place with the others shown. In process (the Makefile's command line through the
dispatcher); `make cancel` cancels a real held job on the local Slurm."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess

import pytest
from slurm_fixtures import held_job

from overlapkit import paths
from overlapkit.cluster import chain, slurm

NOT_REGULAR = "is not a regular file (a FIFO, socket or device): give the file itself"


@pytest.fixture
def shared(tmp_path):
    """(CLUSTER= a profile whose job_dir is a fresh shared directory, that directory's runs/)."""
    local = (paths.REPO_ROOT / "slurm" / "profiles" / "local.toml").read_text()
    profile = tmp_path / "shared.toml"
    lines = [f'job_dir = "{tmp_path / "jobs"}"' if line.startswith("job_dir") else line for line in local.splitlines()]
    profile.write_text("\n".join(lines) + "\n")
    (tmp_path / "jobs" / "runs").mkdir(parents=True)
    return f"CLUSTER={profile}", tmp_path / "jobs" / "runs"


def _run(runs, name: str, write_plan, **record):
    """A run directory with plan.json and the submission record `record`, written an hour ago (older than any
    planted one)."""
    run_dir = runs / name
    run_dir.mkdir()
    write_plan(run_dir)
    (run_dir / chain.MARKER).write_text(json.dumps({"state": "submitted", **record}))
    os.utime(run_dir / chain.MARKER, (os.path.getmtime(run_dir) - 3600,) * 2)
    return run_dir


def _plant(path, kind: str):
    """`kind` at `path`, as a co-user with write access to the shared directory can make it."""
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a blocking open waits forever
    elif kind == "socket":
        with contextlib.chdir(path.parent):  # a socket's path is at most 107 bytes: bind by its name
            socket.socket(socket.AF_UNIX).bind(path.name)
    elif kind == "device":
        path.symlink_to("/dev/zero")  # endless
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text('{"state": "submitted", "job_id": "--user=root"}')  # valid JSON, a job id that is an option


KINDS = ["fifo", "socket", "device", "directory", "edited"]


@pytest.mark.parametrize("kind", KINDS)
def test_make_status_passes_over_a_planted_record_to_the_latest_readable_run(
    shared, make_here, write_plan, kind, within
):
    cluster, runs = shared
    good = _run(runs, "good-run", write_plan, job_id="999990", job_ids=["999990"])
    (runs / "planted").mkdir()
    _plant(runs / "planted" / chain.MARKER, kind)
    with within(20):
        code, out, err = make_here("status", cluster)
    assert code == 0 and out.splitlines()[0] == f"{good.name}:" and out.splitlines()[1].startswith("  job 999990 ")
    [note] = err.splitlines()
    assert note.startswith(f"note: skipped {runs / 'planted' / chain.MARKER}: ") and "Traceback" not in err
    if kind in ("fifo", "device"):
        assert note.endswith(NOT_REGULAR)
    with within(20):  # the planted run itself, asked for: one line naming the file, exit 2
        code, out, err = make_here("status", cluster, f"RUN={runs / 'planted'}")
    assert code == 2 and not out and err.count("\n") == 1 and f"{runs / 'planted' / chain.MARKER}: " in err


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_make_logs_shows_every_log_it_can_and_says_which_it_cannot(
    shared, make_here, write_plan, tmp_path, kind, within
):
    cluster, runs = shared
    exp = tmp_path / "jobs" / "experiments" / "r" / "r_1"
    (exp / "train").mkdir(parents=True)
    (exp / "_CONFIG").write_text("{}")
    (exp / "train" / "sbatch_root-root.train_999990.out").write_text("the job's own log\n")
    _plant(exp / "train" / "log-root-root.train_999990_0.out", kind)
    _run(runs, "good-run", write_plan, job_id="999990", job_ids=["999990"], experiment_dir=str(exp))
    with within(20):
        code, out, err = make_here("logs", cluster)
    planted = exp / "train" / "log-root-root.train_999990_0.out"
    assert code == 2 and "the job's own log" in out and f"(not shown: {planted}: " in out
    assert err.startswith("error: 1 of the job's 2 log file(s) not shown: ") and err.count("\n") == 1


@pytest.mark.slurm
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_make_cancel_cancels_the_latest_run_past_a_planted_record(shared, make_here, write_plan, kind, within):
    cluster, runs = shared
    job = held_job()
    try:
        good = _run(runs, "good-run", write_plan, job_id=job, job_ids=[job])
        (runs / "planted").mkdir()
        _plant(runs / "planted" / chain.MARKER, kind)
        with within(30):
            code, out, err = make_here("cancel", cluster)
        assert code == 0 and out == f"cancelled job {job} ({good.name})\n", (out, err)
        assert err.startswith(f"note: skipped {runs / 'planted' / chain.MARKER}: ")
        assert slurm.wait_for(job, timeout=60, poll=1).startswith("CANCELLED")
    finally:
        subprocess.run(["scancel", job], check=False)
