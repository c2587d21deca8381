"""One live run per checkpoint directory: a RUN_NAME may be reused to continue a run that has ended (the feature),
never by a second run while the first is queued or running (two trainings saving into one directory overwrite
each other's iterations and tracker, and the next segment resumes from whichever wrote last).

A submission holds the directory's lock file across "is a run live? → sbatch → record the job ids", so of two
submitters typed at once the second finds the first's jobs recorded and live (squeue's word), and is refused.

The lock is a file created with O_CREAT|O_EXCL (atomic on NFSv3+ and Lustre: open(2)), not flock/fcntl: on the
shared filesystem flock is fcntl byte-range locks needing lockd on NFS (flock(2)), and is coherent across Lustre
clients only when mounted `-o flock` (mount.lustre(8)). A lock whose holder died is stale: its pid is gone (same
host), or it is older than STALE_S (another host); it is removed under a second O_EXCL lock, so two submitters that
both find it stale cannot both take it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import time
import uuid
from pathlib import Path

from overlapkit import jsonio, makewatch
from overlapkit.cluster import slurm
from overlapkit.errors import BadInput

LOCK = "overlapkit-submit.lock"
RECORD = "overlapkit-runs.json"  # every submission onto this directory: run directory, job ids, time
# A submission holds the lock for sbatch of every segment (nemo_run, one sbatch each, 30 s timeout apiece in a slow
# controller's worst case) and the record write: ten minutes is far beyond that, short enough to recover unattended.
STALE_S = 600
BREAK_STALE_S = 30  # the breaker's own lock is held for one read and one unlink
WAIT_S = 300  # how long a second submitter waits for the first to record its jobs


class LiveRun(BadInput):
    """One line: another run is live on this checkpoint directory (or the lock cannot be had)."""


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _create(path: Path, record: dict) -> bool:
    """Create `path` holding `record` if it does not exist (atomically); False if it does."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(jsonio.dumps(record))
        f.flush()
        os.fsync(f.fileno())
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def stale(path: Path, holder: dict | None, stale_s: float = STALE_S) -> bool:
    """Is the lock at `path` (its content `holder`; None while its creator writes it) left by a dead submitter?"""
    pid = holder.get("pid") if holder else None
    if holder and holder.get("host") == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool):
        return not makewatch.alive(pid)  # a pid of another type ("abc", "²"): not ours to ask; age decides
    return _age(path) > (stale_s if holder else max(stale_s / 60, 5.0))


@contextlib.contextmanager
def held(directory: Path, wait_s: float = WAIT_S, poll: float = 0.5):
    """The checkpoint directory's lock for the block: waits `wait_s` for a live holder, takes over a stale one, and is
    released only if it is still ours."""
    directory.mkdir(parents=True, exist_ok=True)
    path, breaker = directory / LOCK, directory / f"{LOCK}.break"
    me = {"host": socket.gethostname(), "pid": os.getpid(), "at": now(), "token": uuid.uuid4().hex}
    deadline = time.monotonic() + wait_s
    while not _create(path, me):
        holder = jsonio.read_json(path)
        if stale(path, holder):  # removed if it still holds `holder`, under the breaker's lock (the module docstring)
            if breaker.exists() and _age(breaker) > BREAK_STALE_S:
                breaker.unlink(missing_ok=True)
            if not _create(breaker, {"host": socket.gethostname(), "pid": os.getpid(), "at": now()}):
                continue
            try:
                if jsonio.read_json(path) == holder:
                    path.unlink(missing_ok=True)
            finally:
                breaker.unlink()
            continue
        if time.monotonic() > deadline:
            who = "a submitter still writing it"
            if holder:
                who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('at')}"
            raise LiveRun(
                f"another submission onto {directory} holds {path} ({who}): wait for it to end; if that process is "
                f"gone (another host's lock counts as stale after {STALE_S} s), remove the file"
            )
        time.sleep(poll)
    try:
        yield path
    finally:
        if (jsonio.read_json(path) or {}).get("token") == me["token"]:
            path.unlink()


def submissions(directory: Path) -> list[dict]:
    """The recorded submissions onto `directory`, oldest first."""
    return jsonio.read_json(Path(directory) / RECORD, list) or []


def record(directory: Path, run_dir: Path, job_ids: list[str]) -> None:
    """Append a submission (call while holding the lock: the record is read, extended and replaced)."""
    entry = {"run_dir": str(run_dir), "job_ids": list(job_ids), "at": now(), "host": socket.gethostname()}
    Path(directory).mkdir(parents=True, exist_ok=True)
    jsonio.write_json(Path(directory) / RECORD, [*submissions(directory), entry])


def live_problem(directory: Path, run_name: str, besides=()) -> str | None:
    """Why a new run may not start on `directory` now (one line naming the fix), or None; Slurm not answering is an
    answer. `besides`: the asking job's own id (a requeued plain-sbatch job is recorded and live, not a second run)."""
    subs = [s for s in submissions(directory) if isinstance(s, dict) and isinstance(s.get("job_ids", []), list)]
    ids = [job for sub in subs for job in sub.get("job_ids", []) if job not in besides]
    try:
        live = slurm.live_jobs(ids)
    except BadInput as exc:  # an edited record: its ids are never handed to squeue
        raise BadInput(f"{Path(directory) / RECORD}: {exc}") from None
    if live is None:
        return f"RUN_NAME={run_name}: Slurm does not answer (squeue), so whether its run is live is unknown: retry"
    if not live:
        return None
    owner = next(s for s in reversed(subs) if set(s.get("job_ids", [])) & {j for j, _ in live})
    jobs = ", ".join(f"{j} {state}" for j, state in live)
    return (
        f"RUN_NAME={run_name} is live in {directory} (job {jobs}, run {owner['run_dir']}): a second run would "
        f"overwrite its checkpoints; `make cancel RUN={owner['run_dir']}` first, or use another RUN_NAME"
    )
