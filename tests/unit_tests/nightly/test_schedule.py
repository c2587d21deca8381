"""The nightly's schedule on its own: AT read by Slurm itself (sbatch --test-only --begin decides what is valid and
which day a time of day means), the successor's begin time, the chain's status as a truth table, and the scheduler's
bookkeeping on the real local Slurm, called in this process with a stand-in for the night's command. The chain
through make, its scheduler jobs firing, is tests/e2e/test_schedule_e2e.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys

import pytest

from launch import commands
from launch import nightly as nightly_command
from overlapkit import jsonio
from overlapkit.cluster import slurm
from overlapkit.cluster.profiles import load_profile
from overlapkit.nightly import chain_status, logparse, schedule

T = dt.datetime
NOW = T(2026, 12, 1, 1, 30, 0)


def _next(now: T, hour: int, minute: int = 0) -> T:
    """A time of day as sbatch(1) documents it: today if still ahead, else tomorrow (the test's own reading)."""
    today = now.replace(hour=hour, minute=minute, second=0)
    return today if today > now else today + dt.timedelta(days=1)


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("02:00", lambda now: _next(now, 2)),
        ("2:30PM", lambda now: _next(now, 14, 30)),
        ("midnight", lambda now: _next(now, 0)),
        ("teatime", lambda now: _next(now, 16)),  # Slurm's own name for 16:00 (sbatch(1), --begin)
        ("now+900", lambda now: now + dt.timedelta(seconds=900)),  # seconds by default
        ("now+2hours", lambda now: now + dt.timedelta(hours=2)),
        ("now+366days", lambda now: now + dt.timedelta(days=366)),  # the bound itself is kept
    ],
)
def test_at_is_read_by_slurm_itself(chain, text, expected):
    """AT goes to sbatch as given: the begin the chain records is Slurm's own (squeue's EligibleTime), and the
    estimate `sbatch --test-only` gives the check and DRYRUN is never before it (later only while the partition is
    busy)."""
    profile, path, _ = chain
    now = schedule.local_now()
    estimate = schedule.first_begin(profile, text)
    schedule.schedule(_request(profile, text))
    begin = schedule.parse_iso(json.loads(path.read_text())["begin"])
    assert abs((begin - expected(now)).total_seconds()) <= 5, (text, begin)
    assert estimate >= begin - dt.timedelta(seconds=5), (text, estimate, begin)


@pytest.mark.slurm
@pytest.mark.parametrize("text", ["25:00", "13:00PM", "0200", "now+5fortnights", "0 2 * * *", "02:00; rm -rf /", "--x"])
def test_at_sbatch_refuses_is_one_line_with_sbatchs_words(text):
    with pytest.raises(schedule.ScheduleError) as exc:
        schedule.first_begin(load_profile("local"), text)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"AT={text!r} is not a start time: sbatch says: ") and "Invalid" in msg
    assert msg.endswith(schedule.FORMS), msg


@pytest.mark.slurm
@pytest.mark.parametrize(
    "text", ["now+367days", "9999-12-31", "now+500000weeks", "now+99999999999weeks", "now+18446744073709551617"]
)
def test_a_begin_past_a_year_is_one_line_with_the_allowed_range(text):
    """Past the bound, as Slurm reads it; and a count Slurm's parse_time would wrap to now (2**64 + 1 seconds reads
    as now there) is refused before sbatch sees it."""
    with pytest.raises(schedule.ScheduleError) as exc:
        schedule.first_begin(load_profile("local"), text)
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 300 and "more than 366 days ahead" in msg and "now+366days" in msg, msg


def test_the_bound_itself_is_kept_when_the_clock_ticks_before_sbatch_reads_it(monkeypatch):
    """AT=now+366days read by sbatch a second after the command read the clock (a loaded machine: CI refused it, sbatch
    reading 2027-12-07T05:09:08 against a now of 05:09:07): the bound is measured from sbatch's reading, not before."""
    before = schedule.local_now()

    def sbatch_reads_a_second_later(at, **_):
        assert at == "now+366days"
        return schedule.iso(before + dt.timedelta(days=366, seconds=1))

    monkeypatch.setattr(slurm, "begin_time", sbatch_reads_a_second_later)
    monkeypatch.setattr(schedule, "local_now", lambda: before + dt.timedelta(seconds=1))  # the clock has ticked
    assert schedule.first_begin(load_profile("local"), "now+366days") == before + dt.timedelta(days=366, seconds=1)


def test_an_empty_at_names_the_forms():
    with pytest.raises(schedule.ScheduleError, match=r"^AT='': give the time the nightly starts every day"):
        schedule.first_begin(load_profile("local"), "  ")


@pytest.mark.parametrize(
    ("prev", "now", "successor"),
    [
        (T(2026, 12, 1, 2), T(2026, 12, 1, 2, 0, 40), T(2026, 12, 2, 2)),  # fired on time: same time tomorrow
        (T(2026, 12, 1, 17, 20, 38), T(2026, 12, 1, 17, 21), T(2026, 12, 2, 17, 20, 38)),  # now+N: +24 h
        (T(2026, 12, 1, 2), T(2026, 12, 1, 9), T(2026, 12, 2, 2)),  # 7 h late: still tomorrow 02:00
        (T(2026, 12, 1, 2), T(2026, 12, 4, 3), T(2026, 12, 5, 2)),  # 3 days late: past nights are not queued
        (T(2026, 12, 31, 2), T(2026, 12, 31, 2, 1), T(2027, 1, 1, 2)),
    ],
)
def test_next_begin(prev, now, successor):
    assert schedule.next_begin(prev, now) == successor


SCHED = {"cluster": "local", "profile": "/repo/slurm/profiles/local.toml", "partition": "local", "account": "root",
         "job_dir": "runs/slurm", "job_dir_given": "", "at": "02:00", "recipes": "", "preflight": "", "iters": 60,
         "min_dp": 2, "active": True, "scheduled_at": "2026-11-20T10:00:00",
         "job_id": "12", "begin": "2026-12-01T02:00:00", "history": []}  # fmt: skip


def test_restart_command_repeats_what_was_asked():
    assert schedule.restart_command(SCHED) == "make nightly-schedule CLUSTER=local AT=02:00"
    more = {**SCHED, "recipes": "a b", "preflight": "1", "iters": 20, "job_dir_given": "/tmp/j"}
    assert schedule.restart_command(more) == (
        "make nightly-schedule CLUSTER=local AT=02:00 RECIPES='a b' PREFLIGHT=1 ITERS=20 JOB_DIR=/tmp/j"
    )


def test_the_chain_runs_the_commands_make_runs():
    """The entry layer hands the library its command lines: each is a row of launch/commands.py's table, routed to
    the action the scheduler means (a renamed target would otherwise leave every queued chain running a dead one)."""
    routes = {"night": ("submit",), "fire": ("schedule-run",)}
    for field, prefix in routes.items():
        python, m, package, name = getattr(nightly_command.SCHEDULER_COMMANDS, field)
        assert (python, m, package) == (sys.executable, "-m", "launch")
        assert commands.COMMANDS[name] == commands.Command("launch.nightly", prefix), field
    *_, report = nightly_command.REPORT_COMMAND
    assert nightly_command.REPORT_COMMAND[:2] == ("-m", "launch")
    assert commands.COMMANDS[report] == commands.Command("launch.nightly", ("report",))


NIGHT = ("/repo/.venv/bin/python", "-m", "launch", "nightly")


def test_the_night_is_make_nightlys_command_and_scrontab_gets_the_same():
    argv = schedule.night_argv({**SCHED, "recipes": "a", "preflight": "1"}, NIGHT)
    assert argv[:4] == list(NIGHT)
    assert argv[argv.index("--recipes") + 1] == "a" and argv[argv.index("--preflight") + 1] == "1"
    opts, line = schedule.scrontab_lines(SCHED, T(2026, 12, 1, 2, 30), NIGHT)
    assert opts.startswith("#SCRON --partition=local --account=root") and line.startswith("30 2 * * * cd ")
    assert "-m launch nightly --cluster /repo/slurm/profiles/local.toml" in line


# --- status: a truth table ---------------------------------------------------------------------------------------
NOW12 = T(2026, 12, 1, 12, 0)
PENDING = {"job_id": "12", "state": "PENDING", "begin": "2026-12-02T02:00:00", "reason": "BeginTime",
           "comment": "x"}  # fmt: skip
FIRED_OK = {"job_id": "11", "begin": "2026-12-01T02:00:00", "fired_at": "2026-12-01T02:00:41", "successor": "12",
            "night": "/j/nightly/20261201-020041", "rc": 0}  # fmt: skip


@pytest.mark.parametrize(
    ("sched", "queued", "ended", "state", "ok", "says"),
    [
        (None, [], None, "none", True, "no nightly schedule for local: start one with make nightly-schedule"),
        ({**SCHED, "active": False, "unscheduled_at": "2026-12-01T09:00:00"}, [], None, "off", True,
         "start again with make nightly-schedule CLUSTER=local AT=02:00"),
        (SCHED, None, None, "unknown", False, "squeue did not answer"),
        (SCHED, [PENDING], None, "pending", True, "scheduler job 12 pending, begins 2026-12-02T02:00:00 (in 14h)"),
        ({**SCHED, "history": [FIRED_OK]}, [PENDING], None, "pending", True, "night /j/nightly/20261201-020041"),
        (SCHED, [{**PENDING, "begin": "2026-12-01T11:50:00"}], None, "pending", True, "(due now)"),
        (SCHED, [{**PENDING, "begin": "2026-12-01T11:00:00", "reason": "Resources"}], None, "late", False,
         "still pending 1h after its begin time 2026-12-01T11:00:00 (squeue reason: Resources)"),
        ({**SCHED, "job_id": "13", "history": [{"job_id": "12", "begin": "2026-12-01T11:59:00",
                                                 "fired_at": "2026-12-01T11:59:30", "successor": "13"}]},
         [{**PENDING, "state": "RUNNING"}, {**PENDING, "job_id": "13"}], None, "pending", True, "launching now"),
        ({**SCHED, "history": [{"job_id": "12", "begin": "2026-12-01T11:59:00", "fired_at": "2026-12-01T11:59:30"}]},
         [{**PENDING, "state": "RUNNING"}], None, "running", True, "scheduler job 12 is RUNNING: launching"),
        (SCHED, [], "CANCELLED by 0", "broken", False,
         "the chain is broken: scheduler job 12 (begin 2026-12-01T02:00:00) ended (CANCELLED by 0) without queueing "
         "a successor, so no night is scheduled; restart with make nightly-schedule CLUSTER=local AT=02:00"),
        ({**SCHED, "job_id": "11", "history": [{**FIRED_OK, "successor_error": "sbatch: error: Invalid account"}]},
         [], "COMPLETED", "broken", False, "(sbatch: sbatch: error: Invalid account)"),
        (SCHED, [PENDING, {**PENDING, "job_id": "14"}], None, "pending", False,
         "also queued for this chain: job 14 (PENDING, begins 2026-12-02T02:00:00)"),
        ({**SCHED, "job_id": "11"}, [PENDING], "COMPLETED", "pending", True, "(schedule.json names job 11: COMPLETED)"),
        ({**SCHED, "history": [{**FIRED_OK, "night": None, "rc": 1}]}, [PENDING], None, "pending", False,
         "the night did not start: fired 2026-12-01T02:00:41 by job 11: `make nightly`'s command exited 1"),
        ({**SCHED, "history": [{k: v for k, v in FIRED_OK.items() if k not in ("rc", "night")}]}, [PENDING], None,
         "pending", False, "whose launch never reported back"),
        ({**SCHED, "scheduled_at": "2026-12-01T08:00:00", "history": [{**FIRED_OK, "rc": 1}]}, [PENDING], None,
         "pending", True, "exited 1"),  # a failure from before the chain was rescheduled: shown, not held against it
        ({**SCHED, "history": [{**FIRED_OK, "begin": "2026-11-28T02:00:00", "fired_at": "2026-11-28T02:00:30"}]},
         [PENDING], None, "pending", False, "3 night(s) did not run between 2026-11-28T02:00:00 and 2026-12-02"),
    ],
)  # fmt: skip
def test_status_truth_table(sched, queued, ended, state, ok, says):
    st = chain_status.analyse(sched, queued, ended, NOW12, "local")
    assert (st.state, st.ok) == (state, ok), st.lines
    assert any(says in line for line in st.lines), st.lines


def _result(recipe, status, ok):
    return {"recipe": recipe, "verdict": {"status": status, "ok": ok}}


def test_last_night_lines(tmp_path):
    night = {"entries": [{"recipe": "a", "job_id": "1"}, {"recipe": "b", "job_id": "2"}, {"recipe": "c",
             "skipped": "too big"}], "report_job_id": "3", "preflight_only": True}  # fmt: skip
    results = [_result("a", "pass", True), _result("b", "regression", False), {"recipe": "c", "skipped": "too big"}]
    lines = chain_status.night_lines(tmp_path, night, results, None)
    assert lines[0] == f"last night: {tmp_path} (2 submitted, 1 skipped, preflight only)"
    assert lines[1] == "verdict: 1 failing (b: regression); 1 pass, 1 regression; report.md there"
    (tmp_path / "junit.xml").write_text("<testsuites/>")
    assert chain_status.night_lines(tmp_path, night, results[:1], None)[1] == (
        "verdict: no failures; 1 pass; report.md + junit.xml there"
    )
    assert "verdict: not yet: summary job 3 is PENDING" in chain_status.night_lines(tmp_path, night, None, "PENDING")
    assert chain_status.night_lines(tmp_path, night, None, "FAILED")[1].startswith(
        "verdict: none: summary job 3 ended FAILED without writing results.json"
    )


def test_last_night_reads_the_results_the_summary_job_writes(tmp_path):
    night_dir = tmp_path / "20261202-020000"
    night_dir.mkdir()
    entry = {"recipe": "a", "job_id": "1", "run_dir": str(tmp_path / "run")}
    night = {"entries": [entry], "report_job_id": "3", "preflight_only": True, "job_dir": str(tmp_path)}
    (night_dir / "night.json").write_text(json.dumps(night))
    # as night_report writes it: a JSON list, one verdict per recipe
    (night_dir / "results.json").write_text(logparse.to_json([_result("a", "pass", True)]) + "\n")
    lines = chain_status._last_night(tmp_path)
    assert lines[1] == "verdict: no failures; 1 pass; report.md there", lines


def test_a_planted_night_record_is_said_in_the_last_night_line_never_a_hang(tmp_path, within):
    night_dir = tmp_path / "20261202-020000"
    night_dir.mkdir()
    os.mkfifo(night_dir / "night.json")  # in the shared job directory, by anyone
    with within(20):
        [line] = chain_status._last_night(tmp_path)
    assert line.startswith(f"last night: {night_dir / 'night.json'}: is not a regular file") and "\n" not in line


# --- the scheduler's bookkeeping on the real local Slurm ------------------------------------------------------------
# Each scheduler job is held by sbatch --begin an hour or two ahead, so none fires here: fire() is called in this
# process as the job would call it. The night it launches is a stand-in for make nightly's command (a Bridge import
# and a whole night: tests/e2e/test_schedule_e2e.py runs that): it writes a night directory where make nightly would,
# recording the job schedule.json names by then and any SLURM_ variable it was handed.
STAND_IN = """
import json, os, pathlib, sys
root = pathlib.Path(sys.argv[sys.argv.index("--job-dir") + 1]) / "nightly"
night = root / "20261201-020040"
night.mkdir(parents=True)
slurm_vars = sorted(k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF")
queued = json.loads((root / "schedule.json").read_text())["job_id"]
(night / "night.json").write_text(json.dumps({"queued": queued, "slurm": slurm_vars}))
"""
STAND_IN_COMMANDS = schedule.Commands(
    night=(sys.executable, "-c", STAND_IN), fire=nightly_command.SCHEDULER_COMMANDS.fire
)


@pytest.fixture
def chain(tmp_path):
    """A profile on the local Slurm with a temporary job_dir, and a function listing its chain's queued jobs; every job
    of the chain is cancelled at the end."""
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    path = schedule.schedule_path(profile)

    def queued() -> list[dict]:
        return [j for j in slurm.queued(schedule.SCHEDULER_NAME) if j["comment"] == str(path)]

    yield profile, path, queued
    for job in queued():
        slurm.cancel(job["job_id"])


def _request(profile, at="now+3600"):
    return schedule.ScheduleRequest(profile=profile, at=at, cluster="local",
                                    commands=STAND_IN_COMMANDS, recipes="a", preflight="1")  # fmt: skip


@pytest.mark.slurm
def test_scheduling_twice_leaves_one_chain_and_unschedule_ends_it(chain):
    """Scheduling again replaces the queued scheduler (scancel); unscheduling cancels the last."""
    profile, path, queued = chain
    schedule.schedule(_request(profile, "now+3600"))
    first = json.loads(path.read_text())
    assert [j["job_id"] for j in queued()] == [first["job_id"]]
    lines = schedule.schedule(_request(profile, "now+7200"))
    second = json.loads(path.read_text())
    assert [j["job_id"] for j in queued()] == [second["job_id"]] != [first["job_id"]]
    assert f"replaced: job {first['job_id']} (was to begin {first['begin']})" in lines
    assert second["at"] == "now+7200" and second["active"] is True
    lines = schedule.unschedule(profile, "local")
    assert lines == [
        f"cancelled: nightly-scheduler job {second['job_id']} (was to begin {second['begin']})",
        "the nightly chain for local is off (its history stays in schedule.json)",
    ]
    assert queued() == [] and json.loads(path.read_text())["active"] is False


@pytest.mark.slurm
def test_fire_queues_the_successor_then_launches_the_night(chain, monkeypatch):
    profile, path, queued = chain
    schedule.schedule(_request(profile))
    first = json.loads(path.read_text())
    monkeypatch.setenv("SLURM_NTASKS", "1")  # as in the 1-task scheduler job
    assert schedule.fire(profile, first["job_id"], STAND_IN_COMMANDS, say=lambda text: None) == 0
    saved = json.loads(path.read_text())
    (successor,) = [j for j in queued() if j["job_id"] != first["job_id"]]
    begin = schedule.parse_iso(first["begin"]) + dt.timedelta(days=1)  # the same time tomorrow
    assert saved["job_id"] == successor["job_id"] and saved["begin"] == successor["begin"] == schedule.iso(begin)
    (fired,) = saved["history"]
    assert fired["job_id"] == first["job_id"] and fired["successor"] == successor["job_id"] and fired["rc"] == 0
    night = json.loads((path.parent / "20261201-020040" / "night.json").read_text())
    assert fired["night"] == str(path.parent / "20261201-020040")
    assert night == {"queued": successor["job_id"], "slurm": []}  # successor first; a login shell's environment
    # a scheduler the chain no longer names (replaced or unscheduled meanwhile) does nothing
    assert schedule.fire(profile, first["job_id"], STAND_IN_COMMANDS, say=lambda text: None) == 0
    assert json.loads(path.read_text())["history"] == saved["history"]


@pytest.mark.slurm
def test_fire_without_a_successor_says_so_and_fails(chain):
    """sbatch refuses the successor (here: the partition the chain was scheduled on is gone): the night still
    launches, the scheduler job fails, and nightly-status calls the chain broken with sbatch's words."""
    profile, path, queued = chain
    schedule.schedule(_request(profile))
    first = json.loads(path.read_text())
    path.write_text(json.dumps({**first, "partition": "gone"}))
    said = []
    assert schedule.fire(profile, first["job_id"], STAND_IN_COMMANDS, say=said.append) == 1
    assert any("no successor queued" in s for s in said)
    saved = json.loads(path.read_text())
    assert saved["job_id"] == first["job_id"] and "invalid partition" in saved["history"][0]["successor_error"].lower()
    assert saved["history"][0]["rc"] == 0 and [j["job_id"] for j in queued()] == [first["job_id"]]
    st = chain_status.analyse(saved, [], "COMPLETED", schedule.local_now(), "local")
    assert st.state == "broken" and "partition" in st.lines[1]


def test_scheduled_lines_offer_scrontab_only_where_it_exists(tmp_path, monkeypatch):
    path = tmp_path / "nightly" / "schedule.json"
    monkeypatch.setattr(schedule.shutil, "which", lambda name: None)
    lines = schedule.scheduled_lines({**SCHED, "job_dir_given": "/tmp/j"}, path, [PENDING], NIGHT)
    assert lines[0] == ("scheduled: nightly-scheduler job 12 on partition local begins 2026-12-01T02:00:00 (AT=02:00), "
                        "then every day at 02:00:00")  # fmt: skip
    assert "replaced: job 12 (was to begin 2026-12-02T02:00:00)" in lines
    assert lines[-1] == ("check: make nightly-status CLUSTER=local JOB_DIR=/tmp/j; "
                         "stop: make nightly-unschedule CLUSTER=local JOB_DIR=/tmp/j")  # fmt: skip
    monkeypatch.setattr(schedule.shutil, "which", lambda name: f"/usr/bin/{name}")
    more = schedule.scheduled_lines(SCHED, path, [], NIGHT)
    assert more[-3].startswith("scrontab is available here") and more[-1].startswith("0 2 * * * cd ")


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"job_id": "--me"}, "job_id is '--me', not a Slurm job id"),  # scancel and squeue would get it
        ({"secrets": ["A,B=1"]}, "secrets entry 'A,B=1' is not an environment variable name"),  # sbatch's --export
        ({"iters": "60"}, "iters is '60': input should be a valid integer"),
        ({"at": None}, "at is None: input should be a valid string"),
    ],
)
def test_a_schedule_record_is_read_through_its_model(tmp_path, edit, said):
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps({**SCHED, **edit}))
    with pytest.raises(jsonio.FileProblem) as exc:
        schedule.read(path)
    assert str(exc.value).startswith(f"{path}: {said}") and "\n" not in str(exc.value)
    path.write_text(json.dumps({k: v for k, v in SCHED.items() if k != "at"}))
    with pytest.raises(jsonio.FileProblem, match="lacks 'at'"):
        schedule.read(path)
    path.write_text(json.dumps(SCHED))
    assert schedule.read(path) == SCHED
