"""`make nightly-status`: a truth table over the schedule file and squeue (is the chain pending, late, running or
broken?), then the last night's directory and verdict."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio, paths
from overlapkit.cluster import slurm
from overlapkit.nightly import schedule
from overlapkit.nightly.nightly import latest_night, read_night
from overlapkit.nightly.schedule import iso, parse_iso


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
    begin = parse_iso(job["begin"]) or parse_iso(sched["begin"])
    if begin and now - begin > schedule.LATE_AFTER:
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
    log = schedule.scheduler_log(sched, last["job_id"])
    if "rc" not in last:
        if state == "running" or last["job_id"] in firing:
            return True, [f"last {where}: launching now"]
        return not current, [f"the night did not start: {where}, whose launch never reported back (see {log})"]
    if last["rc"] != 0 or not last.get("night"):
        exited = f"`make nightly`'s command exited {last['rc']}"
        return not current, [f"the night did not start: {where}: {exited} (see {log})"]
    return True, [f"last {where}: night {paths.repo_relative(Path(last['night']))}"]


def analyse(
    sched: dict | None, queued: list[dict] | None, ended: str | None, now: dt.datetime, cluster: str
) -> ChainStatus:
    """The chain's health from the schedule file, this chain's jobs in squeue (None: squeue did not answer) and,
    when the job the file names is not queued, Slurm's last word on it (`ended`, from sacct)."""
    if not sched:
        hint = f"no nightly schedule for {cluster}: start one with make nightly-schedule CLUSTER={cluster} AT=02:00"
        return ChainStatus("none", True, [hint])
    restart = schedule.restart_command(sched)
    if not sched.get("active"):
        off = f"unscheduled at {sched.get('unscheduled_at')}: no night is queued; start again with {restart}"
        return ChainStatus("off", True, [off])
    head = (
        f"schedule: AT={sched['at']} every day, RECIPES={sched['recipes'] or '(all)'} "
        f"PREFLIGHT={sched['preflight'] or '(off)'} (scheduled {sched.get('scheduled_at')})"
    )
    if queued is None:
        unknown = (
            f"squeue did not answer: cannot tell whether scheduler job {sched['job_id']} is queued (is Slurm up? sinfo)"
        )
        return ChainStatus("unknown", False, [head, unknown])
    fired = {h.get("job_id") for h in sched.get("history") or []}
    firing = {j["job_id"] for j in queued if j["state"] != "PENDING" and j["job_id"] in fired}  # successor queued
    job = next((j for j in queued if j["job_id"] == sched["job_id"]), None)
    job = job or next((j for j in queued if j["job_id"] not in firing), None)
    state, lines = _chain_state(sched, job, ended, now, restart)
    others = [
        f"also queued for this chain: job {j['job_id']} ({j['state']}, begins {j['begin']}); {restart} leaves one"
        for j in queued
        if j is not job and j["job_id"] not in firing
    ]
    fire_ok, fire_lines = _last_fire(sched, state, firing)
    # whole nights between the last firing (since this chain was scheduled) and the next begin
    since = [h for h in sched.get("history") or [] if h.get("fired_at", "") >= sched.get("scheduled_at", "")]
    missed = []
    if since and job is not None and state in ("pending", "late"):
        last, nxt = parse_iso(since[-1].get("begin")), parse_iso(job["begin"]) or parse_iso(sched["begin"])
        days = round((nxt - last) / dt.timedelta(days=1)) if last and nxt else 1
        if days > 1:
            missed.append(
                f"{days - 1} night(s) did not run between {iso(last)} and {iso(nxt)}: the scheduler started over a "
                "day late (a full or down partition); check sacct for it"
            )
    ok = state in ("pending", "running") and fire_ok and not missed and not others
    return ChainStatus(state, ok, [head, *lines, *others, *fire_lines, *missed])


def night_lines(night_dir: Path, night: dict, results: list[dict] | None, report_state: str | None) -> list[str]:
    """The last night's directory and verdict (results.json, written by its summary job), or why there is none."""
    entries = night.get("entries", [])
    sent = sum(1 for e in entries if e.get("job_id"))
    kind = ", preflight only" if night.get("preflight_only") else ""
    lines = [f"last night: {paths.repo_relative(night_dir)} ({sent} submitted, {len(entries) - sent} skipped{kind})"]
    rid = night.get("report_job_id")
    if results is None:
        if report_state and report_state.startswith(slurm.TERMINAL):
            return lines + [
                f"verdict: none: summary job {rid} ended {report_state} without writing results.json "
                f"(see report-{rid}.out there)"
            ]
        return lines + [f"verdict: not yet: summary job {rid} is {report_state or 'unknown to Slurm'}"]
    judged = [r for r in results if not r.get("skipped")]
    failing = [f"{r['recipe']}: {r['verdict']['status']}" for r in judged if not r["verdict"]["ok"]]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["verdict"]["status"] for r in judged).items()))
    head = f"verdict: {len(failing)} failing ({'; '.join(failing)})" if failing else "verdict: no failures"
    junit = " + junit.xml" if (night_dir / "junit.xml").is_file() else ""
    return lines + [f"{head}; {counts or 'nothing judged'}; report.md{junit} there"]


def _last_night(root: Path) -> list[str]:
    if (night_dir := latest_night(root)) is None:
        return [f"last night: none yet under {paths.repo_relative(root)}"]
    try:  # the chain's lines above still print when the night's record cannot be read (planted, edited)
        night = read_night(night_dir)
    except jsonio.FileProblem as exc:
        return [f"last night: {exc}"]
    # a list, one verdict per recipe; None: the report job has not written it (yet)
    results = jsonio.read_json(night_dir / "results.json", kind=list)
    rid = night.get("report_job_id")
    return night_lines(night_dir, night, results, slurm.job_state(rid) if rid and results is None else None)


def status(profile, cluster: str, now: dt.datetime | None = None) -> ChainStatus:
    """`make nightly-status`: the chain (analyse) and the last night."""
    path = schedule.schedule_path(profile)
    sched = schedule.read(path)
    active = bool(sched and sched.get("active"))
    queued = schedule.chain_jobs(path) if active else []
    ended = None
    if active and queued is not None and sched.get("job_id") not in {j["job_id"] for j in queued}:
        ended = slurm.job_state(sched["job_id"]) if sched.get("job_id") else None
    st = analyse(sched, queued, ended, now or schedule.local_now(), cluster)
    st.lines += _last_night(profile.job_path / "nightly")
    return st
