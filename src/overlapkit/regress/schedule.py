"""The nightly runs itself: a chain of small `sbatch --begin` jobs, each launching one night and queueing the next.

Login nodes often forbid cron, and a laptop's cron dies with the laptop. Slurm's own cron (`scrontab`) is not built
on every site (Debian's Slurm 22.05 packages, the local dev Slurm included, ship none), but every Slurm honours
`sbatch --begin`. So `make nightly-schedule CLUSTER=<profile> AT=<time>` submits one small CPU job, the scheduler,
held until AT. When it runs (`python -m launch.nightly schedule-run`) it first queues its successor for the same time
of day tomorrow, then launches the night exactly as `make nightly` does (`python -m launch.nightly submit`: audit,
ledger, preflight, summary job). Successor first: a night that fails to launch, or a scheduler killed at its time
limit, must not end the chain.

The chain's state is `<profile job_dir>/nightly/schedule.json`: the queued scheduler's job id and begin time, AT, the
night's options and the history of fired runs. Every scheduler job is named `nightly-scheduler` and carries the
schedule file's path as its Slurm comment, so squeue finds one chain's jobs and never another's (another profile's,
or a test's temporary job_dir). Scheduling again queues the new scheduler, then cancels the chain's other queued
ones, so there is never a second chain; the file is read, changed and written under a lock, and a scheduler that
fires finds out there whether it is still the chain's.

Times are the local wall clock of the machine that runs sbatch, as sbatch itself reads --begin and squeue prints it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio, stack
from overlapkit.cluster import slurm
from overlapkit.regress.nightly import MIN_DP, latest_night
from overlapkit.regress.rules import NIGHTLY_ITERS

SCHEDULER_NAME = "nightly-scheduler"  # fixed, so `squeue -n nightly-scheduler` lists every chain's next night
SCHEDULE_FILE = "schedule.json"
# The scheduler plans and submits every recipe (a Bridge import plus one plan per recipe: minutes on a login-class
# CPU); an hour is ample, and short enough for partitions with a low MaxTime.
SCHEDULER_TIME = "01:00:00"
# Slurm starts a job whose begin time has come at its next scheduling pass (sbatch(1), --begin: "the job will be
# eligible to start on the next poll ... e.g., 60 seconds with the default sched/builtin"), later if the partition
# is full. Still pending this long after its begin time, the night is late, and nightly-status says so.
LATE_AFTER = dt.timedelta(minutes=15)
HISTORY_KEEP = 400  # fired runs kept in schedule.json: over a year of nights

# --- AT: the subset of sbatch --begin we accept --------------------------------------------------------------------
# Slurm's parse_time() (src/common/parse_time.c, quoted by sbatch(1) under --begin) takes HH:MM[:SS] with an optional
# AM/PM, the named times below, now+count[seconds(default)|minutes|hours|days|weeks] (whole unit names, singular or
# plural), and YYYY-MM-DD[THH:MM[:SS]]. Left out on purpose: now-N and past dates (a nightly cannot start in the
# past), MMDD[YY] and MM/DD[/YY] (read differently by different people), today/tomorrow (a date, not a time of day).
NAMED = {"midnight": 0, "elevenses": 11, "noon": 12, "fika": 15, "teatime": 16}
UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
FORMS = ("HH:MM[:SS] (02:00, 2:30PM), midnight|noon|elevenses|fika|teatime, now+N[seconds|minutes|hours|days|weeks] "
         "(now+90 is 90 seconds, now+2hours), or YYYY-MM-DD[THH:MM[:SS]] (2026-12-02T02:00)")  # fmt: skip
_CLOCK = re.compile(r"(?P<h>\d{1,2}):(?P<m>\d{2})(?::(?P<s>\d{2}))?\s*(?P<half>[ap]m)?", re.IGNORECASE)
_NOW = re.compile(r"now\+(?P<n>\d+)(?P<unit>[a-z]*)", re.IGNORECASE)
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?")
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S"  # what --begin takes and squeue's EligibleTime prints


class ScheduleError(ValueError):
    """One-line, user-facing."""


@dataclass(frozen=True)
class At:
    """A parsed AT: a time of day (daily from the soonest one), an offset from now, or a date and time."""

    text: str
    clock: tuple[int, int, int] | None = None
    offset_s: int | None = None
    when: dt.datetime | None = None


def _bad_at(text: str) -> ScheduleError:
    return ScheduleError(f"AT={text!r} is not a start time; use {FORMS}")


def _clock(m: re.Match, text: str) -> tuple[int, int, int]:
    h, minute, s = int(m["h"]), int(m["m"]), int(m["s"] or 0)
    half = (m["half"] or "").lower()
    if half and not 1 <= h <= 12 or h > 23 or minute > 59 or s > 59:  # parse_time.c _get_time's ranges
        raise _bad_at(text)
    if half == "am":
        h %= 12  # 12:30AM is 00:30
    elif half == "pm":
        h = h % 12 + 12  # 12:30PM is 12:30
    return h, minute, s


def parse_at(text: str) -> At:
    """AT as make takes it → At; anything else is one ScheduleError naming the accepted forms."""
    t = (text or "").strip()
    if not t:
        raise ScheduleError(f"AT='': give the time the nightly starts every day; use {FORMS}")
    if t.lower() in NAMED:
        return At(t, clock=(NAMED[t.lower()], 0, 0))
    if m := _CLOCK.fullmatch(t):
        return At(t, clock=_clock(m, t))
    if m := _NOW.fullmatch(t):
        unit = m["unit"].lower().removesuffix("s")
        if m["unit"] and unit not in UNITS:
            raise _bad_at(t)
        return At(t, offset_s=int(m["n"]) * UNITS.get(unit, 1))
    if _ISO.fullmatch(t):
        try:
            return At(t, when=dt.datetime.fromisoformat(t))
        except ValueError:
            raise _bad_at(t) from None
    raise _bad_at(t)


def check_at(text: str) -> At:
    """parse_at, and a date and time must still be ahead."""
    at = parse_at(text)
    first_begin(at, local_now())
    return at


def first_begin(at: At, now: dt.datetime) -> dt.datetime:
    """When the first night starts. A time of day is today if it is still ahead (to the minute, as parse_time.c
    decides), else tomorrow; a date and time must be in the future."""
    now = now.replace(microsecond=0)
    if at.offset_s is not None:
        return now + dt.timedelta(seconds=at.offset_s)
    if at.when is not None:
        if at.when <= now:
            raise ScheduleError(f"AT={at.text!r} is in the past (now {iso(now)}): give a later date and time, or a "
                                "time of day such as 02:00")  # fmt: skip
        return at.when
    h, m, s = at.clock
    today = now.replace(hour=h, minute=m, second=s)
    return today if (h, m) > (now.hour, now.minute) else today + dt.timedelta(days=1)


def next_begin(prev: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The successor's begin: the same wall-clock time the next day (so now+N repeats 24 h after the first night;
    across a DST change the time of day is kept). A scheduler that started more than a day late skips the nights
    already past rather than queueing them all at once."""
    begin = prev + dt.timedelta(days=1)
    while begin <= now:
        begin += dt.timedelta(days=1)
    return begin


def iso(t: dt.datetime) -> str:
    return t.strftime(_ISO_FORMAT)


def _parse_iso(text: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None  # squeue prints N/A or Unknown for a time it does not know


def local_now() -> dt.datetime:
    return dt.datetime.now().replace(microsecond=0)


# --- the schedule file -----------------------------------------------------------------------------------------------


def schedule_path(profile) -> Path:
    return profile.job_path / "nightly" / SCHEDULE_FILE


def read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{path}: not valid JSON ({exc}); move it away and schedule again") from None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside the schedule file, held while it is read, changed and written. A filesystem without
    flock (Lustre mounted without -o flock) gives none; the job-id check in fire() still keeps one chain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def restart_command(sched: dict) -> str:
    """The make command that (re)starts this chain as it was asked for."""
    words = ["make", "nightly-schedule", f"CLUSTER={shlex.quote(sched['cluster'])}", f"AT={shlex.quote(sched['at'])}"]
    for var, key, default in (("RECIPES", "recipes", ""), ("PREFLIGHT", "preflight", ""),
                              ("ITERS", "iters", NIGHTLY_ITERS), ("MIN_DP", "min_dp", MIN_DP),
                              ("JOB_DIR", "job_dir_given", "")):  # fmt: skip
        if sched.get(key, default) not in (default, None):
            words.append(f"{var}={shlex.quote(str(sched[key]))}")
    return " ".join(words)


def _where(sched: dict) -> str:
    """CLUSTER= (and JOB_DIR= when one was given) for the hints."""
    job_dir = f" JOB_DIR={shlex.quote(sched['job_dir_given'])}" if sched.get("job_dir_given") else ""
    return f"CLUSTER={shlex.quote(sched['cluster'])}{job_dir}"


def night_argv(sched: dict) -> list[str]:
    """What the scheduler runs for the night: the command `make nightly` runs, with the same options."""
    return [sched["python"], "-m", "launch.nightly", "submit", "--cluster", sched["profile"],
            "--job-dir", sched["job_dir"], "--preflight", sched["preflight"], "--recipes", sched["recipes"],
            "--iters", str(sched["iters"]), "--min-dp", str(sched["min_dp"])]  # fmt: skip


def scrontab_lines(sched: dict, begin: dt.datetime) -> list[str]:
    """The same nightly as a scrontab entry (scrontab(1): `#SCRON` lines carry sbatch options; cron fields are
    minute hour day month weekday), for sites that build scrontab."""
    opts = f"#SCRON --partition={sched['partition']} --account={sched['account']} --time={SCHEDULER_TIME} -J nightly"
    cmd = f"cd {shlex.quote(str(stack.REPO_ROOT))} && PYTHONPATH=src:. {shlex.join(night_argv(sched))}"
    return [opts, f"{begin.minute} {begin.hour} * * * {cmd}"]


# --- scheduling, firing, unscheduling (Slurm calls through cluster.slurm) ---------------------------------------------


@dataclass(frozen=True)
class ScheduleRequest:
    profile: object  # cluster.profiles.ClusterProfile, loaded from a file (the scheduler job reloads it)
    at: At
    cluster: str  # CLUSTER= as given: the restart hint repeats it
    job_dir: str = ""  # JOB_DIR= as given ("" = the profile's)
    recipes: str = ""  # RECIPES= as given ("" = every recipe)
    preflight: str = ""  # PREFLIGHT= as given
    iters: int = NIGHTLY_ITERS
    min_dp: int = MIN_DP
    python: str = field(default_factory=lambda: sys.executable)


def check_partition(profile) -> None:
    """Before anything is submitted: the profile's partition must be one sinfo knows."""
    if slurm.partition_nodes(profile.partition) is None:
        raise ScheduleError(
            f"partition {profile.partition!r} ({profile.source}) has no nodes in sinfo: set partition to one "
            "`sinfo -s` lists (or start Slurm, if sinfo does not answer)"
        )


def check_recipes(names: list[str]) -> None:
    """Unknown recipe names fail now, not at 02:00 (needs the registry, so Bridge: only when RECIPES= is given)."""
    from overlapkit.plan import registry

    stack.import_bridge()
    for name in names:
        registry.get(name)


def chain_jobs(path: Path) -> list[dict] | None:
    """This chain's scheduler jobs in squeue (by name and comment); None when squeue does not answer."""
    jobs = slurm.queued(SCHEDULER_NAME)
    return None if jobs is None else [j for j in jobs if j["comment"] == str(path)]


def _cancel(job_id: str) -> bool:
    """True when this call cancelled the job; False when it had ended meanwhile or scancel refused."""
    try:
        return slurm.cancel(job_id) is None
    except RuntimeError:
        return False


def _queued_or_fail(path: Path, doing: str) -> list[dict]:
    jobs = chain_jobs(path)
    if jobs is None:
        raise ScheduleError(f"squeue did not answer, so the queued scheduler jobs are unknown; {doing} (sinfo?)")
    return jobs


def submit_scheduler(sched: dict, path: Path, begin: dt.datetime) -> str:
    """One scheduler job held until `begin`; it reruns this module's fire() from the checkout, with the python
    that scheduled it (the one `make nightly` uses: it plans with Bridge and submits with nemo_run)."""
    cmd = (f"cd {shlex.quote(str(stack.REPO_ROOT))} && PYTHONPATH=src:. {shlex.quote(sched['python'])} "
           f"-m launch.nightly schedule-run --cluster {shlex.quote(sched['profile'])} "
           f"--job-dir {shlex.quote(sched['job_dir'])}")  # fmt: skip
    return slurm.sbatch_wrap(cmd, account=sched["account"], partition=sched["partition"], name=SCHEDULER_NAME,
                             output=str(path.parent / "scheduler-%j.out"), after=[], time_limit=SCHEDULER_TIME,
                             begin=iso(begin), comment=str(path))  # fmt: skip


def new_schedule(req: ScheduleRequest, old: dict | None, now: dt.datetime) -> dict:
    p = req.profile
    if p.path is None:
        raise ScheduleError(f"profile {p.name} has no file: the scheduler job reloads it, give CLUSTER=<name|.toml>")
    return {"cluster": req.cluster, "profile": str(p.path), "partition": p.partition, "account": p.account,
            "job_dir": p.job_dir, "job_dir_given": req.job_dir, "at": req.at.text, "recipes": req.recipes,
            "preflight": req.preflight, "iters": req.iters, "min_dp": req.min_dp, "python": req.python,
            "active": True, "scheduled_at": iso(now), "job_id": None, "begin": None,
            "history": (old or {}).get("history", [])}  # fmt: skip


def schedule(req: ScheduleRequest, now: dt.datetime | None = None) -> tuple[dict, list[dict]]:
    """Queue a scheduler held until AT, then cancel this chain's other queued ones (new first: if sbatch refuses,
    the old chain stands), and record it. Returns the schedule and the jobs it replaced."""
    path = schedule_path(req.profile)
    with _locked(path):
        sched = new_schedule(req, read(path), now or local_now())
        queued = _queued_or_fail(path, "nothing scheduled")
        begin = first_begin(req.at, now or local_now())
        sched.update(job_id=submit_scheduler(sched, path, begin), begin=iso(begin))
        replaced = [j for j in queued if j["state"] == "PENDING" and _cancel(j["job_id"])]
        jsonio.write_json(path, sched)
    return sched, replaced


def unschedule(profile, now: dt.datetime | None = None) -> tuple[dict | None, list[dict], list[dict]]:
    """Cancel the chain's queued scheduler jobs and mark the chain off. Returns the schedule (None: there was none),
    the cancelled jobs, and any scheduler running now (one that has not reached the lock finds the chain off and
    does nothing; one past it has queued its successor, cancelled here, and launches its night)."""
    path = schedule_path(profile)
    with _locked(path):
        sched = read(path)
        queued = _queued_or_fail(path, "nothing cancelled")
        cancelled = [j for j in queued if j["state"] == "PENDING" and _cancel(j["job_id"])]
        if sched:
            sched.update(active=False, unscheduled_at=iso(now or local_now()), job_id=None)
            jsonio.write_json(path, sched)
    return sched, cancelled, [j for j in queued if j["state"] != "PENDING"]


def _leave_job_environment() -> None:
    """Run as if from a login shell. sbatch exports the caller's environment (--export=ALL), and srun reads SLURM_*
    as its options (SLURM_NTASKS is -n), so a night launched from inside this 1-task job would hand SLURM_NTASKS=1
    and the rest to every run's srun. SLURM_CONF stays: it says which cluster to talk to."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if name != "SLURM_CONF":
            del os.environ[name]


def _queue_successor(sched: dict, path: Path, job_id: str, now: dt.datetime, say) -> dict:
    """Queue tomorrow's scheduler and record this firing; the schedule now names the successor (or, if sbatch
    refused, still names this job, which nightly-status then reports as a broken chain)."""
    fired = {"job_id": job_id, "begin": sched["begin"], "fired_at": iso(now)}
    begin = next_begin(_parse_iso(sched["begin"]) or now, now)
    try:
        fired["successor"] = submit_scheduler(sched, path, begin)
        sched.update(job_id=fired["successor"], begin=iso(begin))
        say(f"queued the successor: job {fired['successor']} begins {iso(begin)}")
    except RuntimeError as exc:
        fired["successor_error"] = str(exc)
        say(f"error: no successor queued, the chain ends here: {exc}")
    sched["history"] = [*sched.get("history", []), fired][-HISTORY_KEEP:]
    return fired


def _nightly_root(sched: dict) -> Path:
    root = Path(sched["job_dir"]).expanduser()
    return (root if root.is_absolute() else stack.REPO_ROOT / root) / "nightly"


def _log(sched: dict, job_id: str) -> str:
    return stack.repo_relative(_nightly_root(sched) / f"scheduler-{job_id}.out")


def launch_night(sched: dict, say) -> tuple[int, str | None]:
    """`make nightly`'s command in a child process (its failure cannot undo the bookkeeping); returns its exit
    status and the night directory it wrote, if any."""
    root = _nightly_root(sched)
    before = set(root.glob("*/night.json"))
    argv = night_argv(sched)
    say(f"$ {shlex.join(argv)}")
    sys.stdout.flush()
    env = {**os.environ, "PYTHONPATH": f"{stack.REPO_ROOT / 'src'}:{stack.REPO_ROOT}"}
    try:
        rc = subprocess.run(argv, cwd=stack.REPO_ROOT, env=env, check=False).returncode
    except OSError as exc:
        say(f"error: could not start the night: {exc}")
        rc = 127
    new = sorted(set(root.glob("*/night.json")) - before)
    return rc, str(new[-1].parent) if new else None


def fire(profile, job_id: str, say=print, now: dt.datetime | None = None) -> int:
    """What the scheduler job runs: queue the successor, launch the night, record both. Exit status: the night's
    launch (non-zero also when no successor could be queued), so Slurm's state of the scheduler job tells."""
    _leave_job_environment()
    path = schedule_path(profile)
    now = now or local_now()
    with _locked(path):
        sched = read(path)
        if not sched or not sched.get("active") or sched.get("job_id") != job_id:
            mine = (sched or {}).get("job_id") if (sched or {}).get("active") else "none: the chain is off"
            say(f"scheduler job {job_id} is no longer this chain's (its queued job: {mine}); nothing to do")
            return 0
        fired = _queue_successor(sched, path, job_id, now, say)
        jsonio.write_json(path, sched)
    rc, night = launch_night(sched, say)
    with _locked(path):
        latest = read(path) or sched
        for entry in latest.get("history", []):
            if entry.get("job_id") == job_id:
                entry.update(night=night, rc=rc)
        jsonio.write_json(path, latest)
    say(f"night launched: {night} (exit {rc})" if night else f"error: the night did not launch (exit {rc})")
    return rc or (0 if "successor" in fired else 1)


def scheduled_lines(sched: dict, path: Path, replaced: list[dict]) -> list[str]:
    """What `make nightly-schedule` prints."""
    daily = _parse_iso(sched["begin"]).strftime("%H:%M:%S")
    lines = [f"scheduled: {SCHEDULER_NAME} job {sched['job_id']} on partition {sched['partition']} begins "
             f"{sched['begin']} (AT={sched['at']}), then every day at {daily}",
             f"each night: RECIPES={sched['recipes'] or '(all)'} PREFLIGHT={sched['preflight'] or '(off)'} "
             f"ITERS={sched['iters']} MIN_DP={sched['min_dp']}, as make nightly runs it",
             *(f"replaced: job {j['job_id']} (was to begin {j['begin']})" for j in replaced),
             f"chain state: {stack.repo_relative(path)}; scheduler log: {stack.repo_relative(path.parent)}/"
             "scheduler-<job>.out",
             f"check: make nightly-status {_where(sched)}; stop: make nightly-unschedule {_where(sched)}"]  # fmt: skip
    if shutil.which("scrontab"):
        lines += ["scrontab is available here: instead of this chain, `make nightly-unschedule` and put these two "
                  "lines in `scrontab -e`:", *scrontab_lines(sched, _parse_iso(sched["begin"]))]  # fmt: skip
    return lines


# --- nightly-status: a truth table over the schedule file and squeue, then the last night ----------------------------


@dataclass
class ChainStatus:
    state: str  # none | off | pending | late | running | broken | unknown
    ok: bool  # False: a night did not start when it should have (or will not): nightly-status exits 1
    lines: list[str]


def _span(delta: dt.timedelta) -> str:
    minutes = int(abs(delta).total_seconds() // 60)
    parts = ((minutes // 1440, "d"), (minutes // 60 % 24, "h"), (minutes % 60, "m"))
    return " ".join(f"{v}{u}" for v, u in parts if v) or "<1m"


def _chain_state(sched: dict, job: dict | None, ended: str | None, now: dt.datetime, restart: str):
    """(state, lines) from the chain's queued job (None: nothing queued)."""
    if job is None:
        err = ((sched.get("history") or [{}])[-1]).get("successor_error")
        return "broken", [
            f"the chain is broken: scheduler job {sched['job_id']} (begin {sched['begin']}) ended "
            f"({ended or 'gone from squeue'}) without queueing a successor{f' (sbatch: {err})' if err else ''}, so "
            f"no night is scheduled; restart with {restart}"
        ]
    note = "" if job["job_id"] == sched["job_id"] else f" (schedule.json names job {sched['job_id']}: {ended})"
    if job["state"] != "PENDING":
        return "running", [f"scheduler job {job['job_id']} is {job['state']}: launching tonight's night{note}"]
    begin = _parse_iso(job["begin"]) or _parse_iso(sched["begin"])
    if begin and now - begin > LATE_AFTER:
        return "late", [
            f"the night has not started: scheduler job {job['job_id']} is still pending {_span(now - begin)} after "
            f"its begin time {iso(begin)} (squeue reason: {job['reason']}){note}"
        ]
    when = f"in {_span(begin - now)}" if begin and begin > now else "due now"
    return "pending", [f"next night: scheduler job {job['job_id']} pending, begins {job['begin']} ({when}){note}"]


def _last_fire(sched: dict, state: str, firing: set[str]) -> tuple[bool, list[str]]:
    """The latest fired run (`firing`: scheduler jobs still running after queueing their successor); a failed
    launch since this chain was (re)scheduled is a night that did not start."""
    history = sched.get("history") or []
    if not history:
        return True, ["last fired: never (the first night is the one above)"]
    last = history[-1]
    current = last.get("fired_at", "") >= sched.get("scheduled_at", "")
    where = f"fired {last.get('fired_at')} by job {last['job_id']}"
    if "rc" not in last:
        if state == "running" or last["job_id"] in firing:
            return True, [f"last {where}: launching now"]
        return not current, [f"the night did not start: {where}, whose launch never reported back (see "
                             f"{_log(sched, last['job_id'])})"]  # fmt: skip
    if last["rc"] != 0 or not last.get("night"):
        return not current, [f"the night did not start: {where}: `make nightly`'s command exited {last['rc']} "
                             f"(see {_log(sched, last['job_id'])})"]  # fmt: skip
    return True, [f"last {where}: night {stack.repo_relative(Path(last['night']))}"]


def _missed(sched: dict, job: dict | None, state: str) -> list[str]:
    """Whole nights between the last firing (since this chain was scheduled) and the next begin."""
    fired = [h for h in sched.get("history") or [] if h.get("fired_at", "") >= sched.get("scheduled_at", "")]
    if not fired or job is None or state not in ("pending", "late"):
        return []
    last, nxt = _parse_iso(fired[-1].get("begin")), _parse_iso(job["begin"]) or _parse_iso(sched["begin"])
    days = round((nxt - last) / dt.timedelta(days=1)) if last and nxt else 1
    if days <= 1:
        return []
    return [f"{days - 1} night(s) did not run between {iso(last)} and {iso(nxt)}: the scheduler started over a day "
            "late (a full or down partition); check sacct for it"]  # fmt: skip


def analyse(sched: dict | None, queued: list[dict] | None, ended: str | None, now: dt.datetime,
            cluster: str) -> ChainStatus:  # fmt: skip
    """The chain's health from the schedule file, this chain's jobs in squeue (None: squeue did not answer) and,
    when the job the file names is not queued, Slurm's last word on it (`ended`, from sacct)."""
    if not sched:
        return ChainStatus("none", True, [f"no nightly schedule for {cluster}: start one with make nightly-schedule "
                                          f"CLUSTER={cluster} AT=02:00"])  # fmt: skip
    restart = restart_command(sched)
    if not sched.get("active"):
        return ChainStatus("off", True, [f"unscheduled at {sched.get('unscheduled_at')}: no night is queued; "
                                         f"start again with {restart}"])  # fmt: skip
    head = (f"schedule: AT={sched['at']} every day, RECIPES={sched['recipes'] or '(all)'} "
            f"PREFLIGHT={sched['preflight'] or '(off)'} (scheduled {sched.get('scheduled_at')})")  # fmt: skip
    if queued is None:
        return ChainStatus("unknown", False, [head, f"squeue did not answer: cannot tell whether scheduler job "
                                                    f"{sched['job_id']} is queued (is Slurm up? sinfo)"])  # fmt: skip
    fired = {h.get("job_id") for h in sched.get("history") or []}
    firing = {j["job_id"] for j in queued if j["state"] != "PENDING" and j["job_id"] in fired}  # successor queued
    job = next((j for j in queued if j["job_id"] == sched["job_id"]), None)
    job = job or next((j for j in queued if j["job_id"] not in firing), None)
    state, lines = _chain_state(sched, job, ended, now, restart)
    others = [f"also queued for this chain: job {j['job_id']} ({j['state']}, begins {j['begin']}); {restart} "
              "leaves one" for j in queued if j is not job and j["job_id"] not in firing]  # fmt: skip
    fire_ok, fire_lines = _last_fire(sched, state, firing)
    missed = _missed(sched, job, state)
    ok = state in ("pending", "running") and fire_ok and not missed and not others
    return ChainStatus(state, ok, [head, *lines, *others, *fire_lines, *missed])


def night_lines(night_dir: Path, night: dict, results: list[dict] | None, report_state: str | None) -> list[str]:
    """The last night's directory and verdict (results.json, written by its summary job), or why there is none."""
    entries = night.get("entries", [])
    sent = sum(1 for e in entries if e.get("job_id"))
    kind = ", preflight only" if night.get("preflight_only") else ""
    lines = [f"last night: {stack.repo_relative(night_dir)} ({sent} submitted, {len(entries) - sent} skipped{kind})"]
    rid = night.get("report_job_id")
    if results is None:
        if report_state and report_state.startswith(slurm.TERMINAL):
            return lines + [f"verdict: none: summary job {rid} ended {report_state} without writing results.json "
                            f"(see report-{rid}.out there)"]  # fmt: skip
        return lines + [f"verdict: not yet: summary job {rid} is {report_state or 'unknown to Slurm'}"]
    judged = [r for r in results if not r.get("skipped")]
    failing = [f"{r['recipe']}: {r['verdict']['status']}" for r in judged if not r["verdict"]["ok"]]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["verdict"]["status"] for r in judged).items()))
    head = f"verdict: {len(failing)} failing ({'; '.join(failing)})" if failing else "verdict: no failures"
    junit = " + junit.xml" if (night_dir / "junit.xml").is_file() else ""
    return lines + [f"{head}; {counts or 'nothing judged'}; report.md{junit} there"]


def _last_night(root: Path) -> list[str]:
    try:
        night_dir = latest_night(root)
    except FileNotFoundError:
        return [f"last night: none yet under {stack.repo_relative(root)}"]
    night = json.loads((night_dir / "night.json").read_text())
    results_file = night_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else None
    rid = night.get("report_job_id")
    return night_lines(night_dir, night, results, slurm.job_state(rid) if rid and results is None else None)


def status(profile, cluster: str, now: dt.datetime | None = None) -> ChainStatus:
    """`make nightly-status`: the chain (analyse) and the last night."""
    path = schedule_path(profile)
    sched = read(path)
    active = bool(sched and sched.get("active"))
    queued = chain_jobs(path) if active else []
    ended = None
    if active and queued is not None and sched.get("job_id") not in {j["job_id"] for j in queued}:
        ended = slurm.job_state(sched["job_id"]) if sched.get("job_id") else None
    st = analyse(sched, queued, ended, now or local_now(), cluster)
    st.lines += _last_night(profile.job_path / "nightly")
    return st


def unscheduled_lines(cluster: str, sched: dict | None, cancelled: list[dict], running: list[dict]) -> list[str]:
    """What `make nightly-unschedule` prints."""
    lines = [f"cancelled: {SCHEDULER_NAME} job {j['job_id']} (was to begin {j['begin']})" for j in cancelled]
    lines += [f"job {j['job_id']} is {j['state']} now: tonight's night may still launch; the chain stays off"
              for j in running]  # fmt: skip
    if not cancelled and not running:
        lines.append(f"no scheduler job was queued for {cluster}")
    lines.append(f"the nightly chain for {cluster} is off" + (" (its history stays in schedule.json)" if sched else ""))
    return lines
