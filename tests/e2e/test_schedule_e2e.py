"""End to end on the real local Slurm: `make nightly-schedule` holds a scheduler job until AT (sbatch --begin); when it
runs it queues its successor for the same time tomorrow and launches the night as `make nightly` does (preflight-only
here: no GPU), whose summary job writes junit.xml; `make nightly-status` and `make nightly-unschedule` read and end the
chain. Every command is a `make` target in a new process, with a temporary JOB_DIR, as a user types it."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from overlapkit import paths
from overlapkit.cluster import slurm
from overlapkit.nightly import schedule

pytestmark = pytest.mark.slurm
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def make(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def chain(jobs: Path) -> list[dict]:
    """This test's scheduler jobs in squeue (the comment names its schedule file)."""
    return [j for j in slurm.queued(schedule.SCHEDULER_NAME) if j["comment"] == str(jobs / "nightly/schedule.json")]


def state(jobs: Path) -> dict:
    return json.loads((jobs / "nightly" / "schedule.json").read_text())


def wait_fired(jobs: Path, job_id: str, timeout: float = 600) -> dict:
    """The history entry of `job_id` once its night's launch has reported back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fired = [h for h in state(jobs)["history"] if h["job_id"] == job_id and "rc" in h]
        if fired:
            return fired[0]
        time.sleep(0.2)  # a file read: the fire is seen as it is written
    log = jobs / "nightly" / f"scheduler-{job_id}.out"
    pytest.fail(f"scheduler job {job_id} did not fire: {slurm.job_state(job_id)}; {log.read_text()[-2000:]}")


def test_bad_input_is_one_line_answered_before_bridge_and_submits_nothing(tmp_path):
    jobs = tmp_path / "jobs"
    profile = (paths.REPO_ROOT / "slurm/profiles/local.toml").read_text().replace('"local"', '"nosuch"')
    (tmp_path / "nosuch.toml").write_text(profile)
    before = {j["job_id"] for j in slurm.queued(schedule.SCHEDULER_NAME)}
    for args, says in [
        (["CLUSTER=local", "AT=25:00"], "error: AT='25:00' is not a start time: sbatch says: Invalid time"),
        (["CLUSTER=local", "AT=now+1h"], "error: AT='now+1h' is not a start time"),
        (["CLUSTER=local", "AT="], "error: AT='': give the time the nightly starts every day"),
        (["CLUSTER=local", "AT=now+99999999999weeks"], "error: AT='now+99999999999weeks' is more than 366 days ahead"),
        (["CLUSTER=local", "AT=now+500000weeks"], "error: AT='now+500000weeks' is more than 366 days ahead"),
        (["CLUSTER=nope", "AT=02:00"], "error: unknown cluster profile 'nope'"),
        ([f"CLUSTER={tmp_path / 'nosuch.toml'}", "AT=now+60"], "error: partition 'nosuch'"),
    ]:
        t0 = time.monotonic()
        out = make("nightly-schedule", *args, f"RECIPES={R8}", "PREFLIGHT=1", f"JOB_DIR={jobs}")
        lines = [ln for ln in out.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", ln)]
        assert out.returncode != 0 and "Error 2" in out.stderr and out.stdout == "", out.stderr
        assert len(lines) == 1 and lines[0].startswith(says), lines
        assert time.monotonic() - t0 < 20  # before the Bridge import (measured facts: ~30 s) RECIPES= needs
    assert not (jobs / "nightly" / "schedule.json").exists()
    assert {j["job_id"] for j in slurm.queued(schedule.SCHEDULER_NAME)} == before


def test_the_chain_fires_launches_the_night_and_queues_its_successor(tmp_path):
    jobs = tmp_path / "jobs"
    out = make("nightly-schedule", "CLUSTER=local", "AT=now+3600", f"JOB_DIR={jobs}")
    assert out.returncode == 0, out.stderr
    (first,) = chain(jobs)
    # scheduling again replaces it: one chain, held until now+60 (seconds: sbatch's default unit)
    night = ("PREFLIGHT=1", f"RECIPES={R8}", f"JOB_DIR={jobs}")
    out = make("nightly-schedule", "CLUSTER=local", "AT=now+60", *night, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"replaced: job {first['job_id']}" in out.stdout
    (job,) = chain(jobs)
    sched = state(jobs)
    begin = dt.datetime.fromisoformat(sched["begin"])
    assert job["job_id"] == sched["job_id"] and job["state"] == "PENDING" and job["reason"] == "BeginTime"
    assert job["begin"] == sched["begin"] and 0 < (begin - dt.datetime.now()).total_seconds() <= 61
    out = make("nightly-status", "CLUSTER=local", f"JOB_DIR={jobs}")
    assert out.returncode == 0 and f"next night: scheduler job {job['job_id']} pending, begins {job['begin']}" in (
        out.stdout
    )

    # Slurm's clock, advanced instead of waited out: the held job is released now, as an operator's `scontrol update
    # StartTime=now` does (Slurm would otherwise start it at its first scheduling pass past AT, up to a minute later
    # still). That it was held until AT is checked above; what fires, and the successor's begin (AT's time tomorrow,
    # from the schedule, not from when it fired), are checked below as before.
    subprocess.run(["scontrol", "update", f"JobId={job['job_id']}", "StartTime=now"], check=True, timeout=30)
    fired = wait_fired(jobs, job["job_id"])
    log = (jobs / "nightly" / f"scheduler-{job['job_id']}.out").read_text()
    assert fired["rc"] == 0 and fired["night"], log[-3000:]
    assert slurm.wait_for(job["job_id"], timeout=120, poll=0.5).split()[0] == "COMPLETED", log[-3000:]
    night = json.loads((Path(fired["night"]) / "night.json").read_text())
    assert [e["recipe"] for e in night["entries"]] == [R8] and night["preflight_only"] and night["entries"][0]["job_id"]
    (succ,) = chain(jobs)  # the successor, the same time tomorrow
    assert succ["job_id"] == fired["successor"] == state(jobs)["job_id"] and succ["state"] == "PENDING"
    assert dt.datetime.fromisoformat(succ["begin"]) - begin == dt.timedelta(days=1)

    assert slurm.wait_for(night["report_job_id"], timeout=900, poll=0.5).split()[0] == "COMPLETED"
    suite = ET.parse(Path(fired["night"]) / "junit.xml").getroot().find("testsuite")
    assert (suite.get("name"), suite.get("tests"), suite.get("failures")) == ("nightly.local", "1", "0")
    out = make("nightly-status", "CLUSTER=local", f"JOB_DIR={jobs}")
    assert out.returncode == 0, out.stdout
    assert f"night {paths.repo_relative(Path(fired['night']))}" in out.stdout
    assert "verdict: no failures; 1 preflight_only; report.md + junit.xml there" in out.stdout

    out = make("nightly-unschedule", "CLUSTER=local", f"JOB_DIR={jobs}")
    assert out.returncode == 0 and f"cancelled: nightly-scheduler job {succ['job_id']}" in out.stdout
    assert chain(jobs) == [] and state(jobs)["active"] is False


def test_a_scheduler_that_died_is_a_broken_chain_with_the_restart_command(tmp_path):
    jobs = tmp_path / "jobs"
    assert make("nightly-schedule", "CLUSTER=local", "AT=02:00", f"JOB_DIR={jobs}").returncode == 0
    (job,) = chain(jobs)
    subprocess.run(["scancel", job["job_id"]], check=True)  # behind the chain's back, as a node failure would
    out = make("nightly-status", "CLUSTER=local", f"JOB_DIR={jobs}")
    assert out.returncode != 0
    assert f"the chain is broken: scheduler job {job['job_id']}" in out.stdout
    assert f"restart with make nightly-schedule CLUSTER=local AT=02:00 JOB_DIR={jobs}" in out.stdout
