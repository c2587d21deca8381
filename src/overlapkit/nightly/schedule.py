"""The nightly runs itself: a chain of small `sbatch --begin` jobs, each launching one night and queueing the next.

Login nodes often forbid cron, and `scrontab` is not built on every site (Debian's Slurm 22.05, the local dev Slurm
included), but every Slurm honours `sbatch --begin`. `make nightly-schedule CLUSTER=<profile> AT=<time>` submits one
small CPU job held until AT; it first queues its successor for the same time tomorrow (so a failed night or a
scheduler killed at its limit does not end the chain), then launches the night as `make nightly` does. The commands
both run are the entry layer's (Commands, from launch/nightly.py); this module only appends their options.

The chain's state is `<profile job_dir>/nightly/schedule.json`, read, changed and written under a lock. Every
scheduler job is named `nightly-scheduler` with the schedule file's path as its Slurm comment, so squeue finds one
chain's jobs and never another's; scheduling again queues the new scheduler, then cancels the chain's other ones.
Times are the local wall clock of the machine that runs sbatch, as sbatch reads --begin and squeue prints it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from overlapkit import jsonio, paths
from overlapkit.cluster import slurm
from overlapkit.errors import BadInput, ClusterFailure
from overlapkit.nightly.nightly import MIN_DP
from overlapkit.nightly.rules import NIGHTLY_ITERS
from overlapkit.spec import model
from overlapkit.spec.schedule import MESSAGES, Schedule

SCHEDULER_NAME = "nightly-scheduler"  # fixed, so `squeue -n nightly-scheduler` lists every chain's next night
SCHEDULE_FILE = "schedule.json"
SCHEDULER_TIME = "01:00:00"  # it plans and submits every recipe (minutes); short enough for a low MaxTime
# Slurm starts a job whose begin time has come at its next scheduling pass (sbatch(1) --begin: ~60 s with
# sched/builtin), later on a full partition. Still pending this long after it, the night is late (nightly-status).
LATE_AFTER = dt.timedelta(minutes=15)
HISTORY_KEEP = 400  # fired runs kept in schedule.json: over a year of nights
# AT is whatever `sbatch --begin` takes: Slurm reads it (slurm.begin_time), we keep no grammar of our own. For help:
FORMS = "a time sbatch --begin takes: 02:00, 2:30PM, midnight, noon, now+90 (seconds), now+2hours, 2026-12-02T02:00"
# Our bound, not Slurm's: a first night more than a year ahead is a typo (a year and a day: the same date next year).
MAX_AHEAD = dt.timedelta(days=366)  # _WITHIN says it
_WITHIN = "the first night starts within 366 days (at most now+366days, or a date before then)"
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S"  # what --begin takes and squeue's EligibleTime prints


class ScheduleError(BadInput):
    """One-line, user-facing."""


def iso(t: dt.datetime) -> str:
    return t.strftime(_ISO_FORMAT)


def parse_iso(text: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None  # squeue prints N/A or Unknown for a time it does not know


def local_now() -> dt.datetime:
    return dt.datetime.now().replace(microsecond=0)


def first_begin(profile, at: str) -> dt.datetime:
    """When the first night starts, as Slurm reads AT on the profile's partition (`sbatch --test-only`, nothing
    queued: a time of day already past today means tomorrow, a past date means at once), within MAX_AHEAD of the
    moment sbatch read it: the clock read after its answer, never before it (AT=now+366days is the bound itself, and
    a second that ticks between a clock read earlier and sbatch's own would put it past the bound)."""
    shown = at if len(at) <= 60 else at[:40] + "…"
    if not at.strip():
        raise ScheduleError(f"AT='': give the time the nightly starts every day; use {FORMS}")
    if re.search(r"\d{10}", at):  # past any begin within a year; Slurm's parse_time wraps such a count to now
        raise ScheduleError(f"AT={shown!r} is more than {MAX_AHEAD.days} days ahead: {_WITHIN}")
    try:
        said = slurm.begin_time(at, account=profile.account, partition=profile.partition, time_limit=SCHEDULER_TIME)
    except BadInput as exc:
        raise ScheduleError(f"AT={shown!r} is not a start time: sbatch says: {exc}; use {FORMS}") from None
    begin = parse_iso(said)  # None: past the year 9999 a datetime holds
    if begin is None or begin - local_now() > MAX_AHEAD:
        raise ScheduleError(f"AT={shown!r} is more than {MAX_AHEAD.days} days ahead (sbatch reads {said}): {_WITHIN}")
    return begin


def next_begin(prev: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The successor's begin: the same wall-clock time the next day (across a DST change too); a scheduler that
    started more than a day late skips the nights already past rather than queueing them all at once."""
    begin = prev + dt.timedelta(days=1)
    while begin <= now:
        begin += dt.timedelta(days=1)
    return begin


# --- the schedule file -----------------------------------------------------------------------------------------------


def schedule_path(profile) -> Path:
    return profile.job_path / "nightly" / SCHEDULE_FILE


def read(path: Path) -> dict | None:
    """The schedule record (None: never scheduled), checked by its model; a FileProblem (one line) for another file."""
    role, fix = "the nightly schedule that make nightly-schedule writes", "move it away and schedule again"
    sched = jsonio.read_json(path, role=role, fix=fix, missing_ok=True)
    if sched:
        try:
            Schedule.model_validate(sched)
        except ValidationError as exc:
            raise jsonio.file_problem(path, model.problem(exc, sched, MESSAGES), role, fix) from None
    return sched


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside the schedule file, held while it is read, changed and written. A filesystem without
    flock (Lustre mounted without -o flock) gives none; the job-id check in fire() still keeps one chain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(jsonio.open_lock(path.with_name(path.name + ".lock"), 0o644)) as f:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def restart_command(sched: dict) -> str:
    """The make command that (re)starts this chain as it was asked for."""
    words = ["make", "nightly-schedule", f"CLUSTER={shlex.quote(sched['cluster'])}", f"AT={shlex.quote(sched['at'])}"]
    for var, key, default in (
        ("RECIPES", "recipes", ""),
        ("PREFLIGHT", "preflight", ""),
        ("ITERS", "iters", NIGHTLY_ITERS),
        ("MIN_DP", "min_dp", MIN_DP),
        ("JOB_DIR", "job_dir_given", ""),
    ):
        if sched.get(key, default) not in (default, None):
            words.append(f"{var}={shlex.quote(str(sched[key]))}")
    return " ".join(words)


def night_argv(sched: dict, command: tuple[str, ...]) -> list[str]:
    """What the scheduler runs for the night: `make nightly`'s command (Commands.night), with the same options."""
    keys = ("profile", "job_dir", "preflight", "recipes", "iters", "min_dp")
    flags = ("--cluster", "--job-dir", "--preflight", "--recipes", "--iters", "--min-dp")
    return [*command, *(word for flag, key in zip(flags, keys, strict=True) for word in (flag, str(sched[key])))]


def scrontab_lines(sched: dict, begin: dt.datetime, command: tuple[str, ...]) -> list[str]:
    """The same nightly as a scrontab entry (scrontab(1): `#SCRON` lines carry sbatch options; cron fields are
    minute hour day month weekday), for sites that build scrontab. `command`: Commands.night."""
    opts = f"#SCRON --partition={sched['partition']} --account={sched['account']} --time={SCHEDULER_TIME} -J nightly"
    cmd = f"cd {shlex.quote(str(paths.REPO_ROOT))} && PYTHONPATH=src:. {shlex.join(night_argv(sched, command))}"
    return [opts, f"{begin.minute} {begin.hour} * * * {cmd}"]


# --- scheduling, firing, unscheduling (Slurm calls through cluster.slurm) ---------------------------------------------


@dataclass(frozen=True)
class Commands:
    """The entry layer's command lines the chain runs, without options: `night` what `make nightly` runs, `fire` what
    each scheduler job runs. Each job hands them to its successor, so a chain keeps the python it began with."""

    night: tuple[str, ...]
    fire: tuple[str, ...]


@dataclass(frozen=True)
class ScheduleRequest:
    profile: object  # cluster.profiles.ClusterProfile, loaded from a file (the scheduler job reloads it)
    at: str  # AT= as given: sbatch --begin reads it
    cluster: str  # CLUSTER= as given: the restart hint repeats it
    commands: Commands
    job_dir: str = ""  # JOB_DIR= as given ("" = the profile's)
    recipes: str = ""  # RECIPES= as given ("" = every recipe)
    preflight: str = ""  # PREFLIGHT= as given
    iters: int = NIGHTLY_ITERS
    min_dp: int = MIN_DP
    dryrun: bool = False  # DRYRUN=1: say what would be queued; queue and write nothing


def check_partition(profile) -> None:
    """Before anything is submitted: a partition sinfo knows, whose nodes can run the one-CPU scheduler job."""
    if bad := slurm.request_problems(profile, 1, SCHEDULER_TIME):
        raise ScheduleError(bad[0])


def chain_jobs(path: Path) -> list[dict] | None:
    """This chain's scheduler jobs in squeue (by name and comment); None when squeue does not answer."""
    jobs = slurm.queued(SCHEDULER_NAME)
    return None if jobs is None else [j for j in jobs if j["comment"] == str(path)]


def _cancel(job_id: str) -> bool:
    """True when this call cancelled the job; False when it had ended meanwhile or scancel refused."""
    try:
        return slurm.cancel(job_id) is None
    except ClusterFailure:
        return False


def _queued_or_fail(path: Path, doing: str) -> list[dict]:
    jobs = chain_jobs(path)
    if jobs is None:
        raise ClusterFailure(f"squeue did not answer, so the queued scheduler jobs are unknown; {doing} (sinfo?)")
    return jobs


def submit_scheduler(sched: dict, path: Path, begin: str, command: tuple[str, ...]) -> str:
    """One scheduler job held until `begin` (any sbatch --begin time) that runs `command` (Commands.fire: this
    module's fire(), under the python that scheduled the chain) from the checkout."""
    argv = [*command, "--cluster", sched["profile"], "--job-dir", sched["job_dir"]]
    cmd = f"cd {shlex.quote(str(paths.REPO_ROOT))} && PYTHONPATH=src:. {shlex.join(argv)}"
    return slurm.sbatch_wrap(
        cmd,
        account=sched["account"],
        partition=sched["partition"],
        name=SCHEDULER_NAME,
        output=str(path.parent / "scheduler-%j.out"),
        after=[],
        time_limit=SCHEDULER_TIME,
        begin=begin,
        comment=str(path),
        secrets=sched.get("secrets", ()),  # the night it launches submits jobs that need them
    )


def new_schedule(req: ScheduleRequest, old: dict | None, now: dt.datetime) -> dict:
    p = req.profile
    if p.path is None:
        raise ScheduleError(f"profile {p.name} has no file: the scheduler job reloads it, give CLUSTER=<name|.toml>")
    asked = {key: getattr(req, key) for key in ("cluster", "at", "recipes", "preflight", "iters", "min_dp")}
    where = {"profile": str(p.path), "partition": p.partition, "account": p.account, "job_dir": p.job_dir}
    # secrets: names only, sbatch passes their values on from the shell (slurm.export_list)
    fresh = {"job_dir_given": req.job_dir, "secrets": list(p.secrets), "active": True, "scheduled_at": iso(now)}
    return Schedule(**asked, **where, **fresh, history=(old or {}).get("history", [])).model_dump()


def schedule(req: ScheduleRequest, now: dt.datetime | None = None) -> list[str]:
    """Queue a scheduler held until AT, then cancel this chain's other queued ones (new first: if sbatch refuses,
    the old chain stands), and record it; what `make nightly-schedule` prints. A dry run queues and writes nothing."""
    path, now = schedule_path(req.profile), now or local_now()
    if req.dryrun:
        new_schedule(req, None, now)  # what it would refuse, it refuses now
        night = f"RECIPES={req.recipes}" if req.recipes else "every recipe"
        return [
            f"dry run: would queue {SCHEDULER_NAME} on partition {req.profile.partition}, held until "
            f"{iso(first_begin(req.profile, req.at))}, then one a day; each runs make nightly ({night}) and "
            f"records {path}",
            "dry run: nothing queued, nothing written",
        ]
    with _locked(path):
        sched = new_schedule(req, read(path), now)
        queued = _queued_or_fail(path, "nothing scheduled")
        expected = iso(first_begin(req.profile, req.at))
        job_id = submit_scheduler(sched, path, req.at, req.commands.fire)
        # the begin Slurm set (EligibleTime), where test-only's estimate could be later on a busy partition
        held = [j["begin"] for j in chain_jobs(path) or [] if j["job_id"] == job_id and parse_iso(j["begin"])]
        sched.update(job_id=job_id, begin=held[0] if held else expected)
        replaced = [j for j in queued if j["state"] == "PENDING" and _cancel(j["job_id"])]
        jsonio.write_json(path, sched)
    return scheduled_lines(sched, path, replaced, req.commands.night)


def unschedule(profile, cluster: str) -> list[str]:
    """Cancel the chain's queued scheduler jobs and mark the chain off; what `make nightly-unschedule` prints. A
    scheduler running now is named: before the lock it finds the chain off, past it it launches its night."""
    path = schedule_path(profile)
    with _locked(path):
        sched = read(path)
        queued = _queued_or_fail(path, "nothing cancelled")
        cancelled = [j for j in queued if j["state"] == "PENDING" and _cancel(j["job_id"])]
        if sched:
            sched.update(active=False, unscheduled_at=iso(local_now()), job_id=None)
            jsonio.write_json(path, sched)
    running = [j for j in queued if j["state"] != "PENDING"]
    lines = [f"cancelled: {SCHEDULER_NAME} job {j['job_id']} (was to begin {j['begin']})" for j in cancelled]
    lines += [
        f"job {j['job_id']} is {j['state']} now: tonight's night may still launch; the chain stays off" for j in running
    ]
    if not cancelled and not running:
        lines.append(f"no scheduler job was queued for {cluster}")
    lines.append(f"the nightly chain for {cluster} is off" + (" (its history stays in schedule.json)" if sched else ""))
    return lines


def _nightly_root(sched: dict) -> Path:
    return paths.in_checkout(sched["job_dir"]) / "nightly"


def scheduler_log(sched: dict, job_id: str) -> str:
    return paths.repo_relative(_nightly_root(sched) / f"scheduler-{job_id}.out")


def fire(profile, job_id: str, commands: Commands, say=print, now: dt.datetime | None = None) -> int:
    """What the scheduler job runs: queue the successor, launch the night (a child process: its failure cannot undo
    the bookkeeping), record both. Exit status: the night's launch (non-zero also without a successor). The night
    runs as if from a login shell: srun reads SLURM_* as options, so this job's SLURM_NTASKS=1 would reach every run
    (SLURM_CONF stays: which cluster)."""
    for name in {n for n in os.environ if n.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))} - {"SLURM_CONF"}:
        del os.environ[name]
    path, now = schedule_path(profile), now or local_now()
    with _locked(path):
        sched = read(path)
        if not sched or not sched.get("active") or sched.get("job_id") != job_id:
            mine = (sched or {}).get("job_id") if (sched or {}).get("active") else "none: the chain is off"
            say(f"scheduler job {job_id} is no longer this chain's (its queued job: {mine}); nothing to do")
            return 0
        # the schedule now names the successor (or, if sbatch refused, still names this job, which nightly-status
        # then reports as a broken chain)
        fired = {"job_id": job_id, "begin": sched["begin"], "fired_at": iso(now)}
        begin = next_begin(parse_iso(sched["begin"]) or now, now)
        try:
            fired["successor"] = submit_scheduler(sched, path, iso(begin), commands.fire)
            sched.update(job_id=fired["successor"], begin=iso(begin))
            say(f"queued the successor: job {fired['successor']} begins {iso(begin)}")
        except ClusterFailure as exc:
            fired["successor_error"] = str(exc)
            say(f"error: no successor queued, the chain ends here: {exc}")
        sched["history"] = [*sched.get("history", []), fired][-HISTORY_KEEP:]
        jsonio.write_json(path, sched)
    root = _nightly_root(sched)
    before = set(root.glob("*/night.json"))
    argv = night_argv(sched, commands.night)
    say(f"$ {shlex.join(argv)}")
    sys.stdout.flush()
    env = {**os.environ, "PYTHONPATH": f"{paths.REPO_ROOT / 'src'}:{paths.REPO_ROOT}"}
    try:
        rc = subprocess.run(argv, cwd=paths.REPO_ROOT, env=env, check=False).returncode
    except OSError as exc:
        say(f"error: could not start the night: {exc}")
        rc = 127
    night = max((str(new.parent) for new in set(root.glob("*/night.json")) - before), default=None)
    with _locked(path):
        latest = read(path) or sched
        for entry in latest.get("history", []):
            if entry.get("job_id") == job_id:
                entry.update(night=night, rc=rc)
        jsonio.write_json(path, latest)
    say(f"night launched: {night} (exit {rc})" if night else f"error: the night did not launch (exit {rc})")
    return rc or (0 if "successor" in fired else 1)


def scheduled_lines(sched: dict, path: Path, replaced: list[dict], command: tuple[str, ...]) -> list[str]:
    """What `make nightly-schedule` prints (`command`: Commands.night, for the scrontab alternative)."""
    daily = parse_iso(sched["begin"]).strftime("%H:%M:%S")
    job_dir = f" JOB_DIR={shlex.quote(sched['job_dir_given'])}" if sched.get("job_dir_given") else ""
    where = f"CLUSTER={shlex.quote(sched['cluster'])}{job_dir}"  # and JOB_DIR= when one was given, for the hints
    lines = [
        f"scheduled: {SCHEDULER_NAME} job {sched['job_id']} on partition {sched['partition']} begins "
        f"{sched['begin']} (AT={sched['at']}), then every day at {daily}",
        f"each night: RECIPES={sched['recipes'] or '(all)'} PREFLIGHT={sched['preflight'] or '(off)'} "
        f"ITERS={sched['iters']} MIN_DP={sched['min_dp']}, as make nightly runs it",
        *(f"replaced: job {j['job_id']} (was to begin {j['begin']})" for j in replaced),
        f"chain state: {paths.repo_relative(path)}; scheduler log: {paths.repo_relative(path.parent)}/"
        "scheduler-<job>.out",
        f"check: make nightly-status {where}; stop: make nightly-unschedule {where}",
    ]
    if shutil.which("scrontab"):
        lines += [
            "scrontab is available here: instead of this chain, `make nightly-unschedule` and put these two "
            "lines in `scrontab -e`:",
            *scrontab_lines(sched, parse_iso(sched["begin"]), command),
        ]
    return lines
