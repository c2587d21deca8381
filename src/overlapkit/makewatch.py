"""Stop when `make` dies: a child of make is not told when make is killed (kill -9), so it would finish its work
unseen (a submission, a data.toml) minutes later. The Makefile exports make's pid as OVERLAPKIT_MAKE_PID;
`watch_make` sends this process SIGTERM once that pid is gone, and what SIGTERM does is the caller's. Linux /proc
reads a pid's ancestry and state; elsewhere the watcher does not start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import threading
import time
from pathlib import Path

MAKE_PID = "OVERLAPKIT_MAKE_PID"
POLL_S = 0.5  # how soon after make's death its child hears of it

_WATCHING: list[threading.Thread] = []


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):  # not an Exception: no `except Exception` on the way may swallow it
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def on_signals(handler=None, signals=STOP_SIGNALS, parent_var: str = MAKE_PID) -> None:
    """The one way every command stops: each of `signals` runs `handler`, by default raising Interrupted so the
    command unwinds and cleans up (a forked worker exits at once, 128+signal: its owner cleans up); make watched."""
    owner = os.getpid()

    def interrupt(signum, _frame):
        if os.getpid() != owner:
            os._exit(128 + signum)
        raise Interrupted(signum)

    for sig in signals:
        signal.signal(sig, handler or interrupt)
    watch_make(parent_var)


def watch_make(parent_var: str = MAKE_PID) -> None:
    """SIGTERM to this process once `make` (its pid in `parent_var`) is gone. Only make's descendants watch: Slurm
    jobs and the plan server's workers inherit the variable too, where that pid means nothing."""
    pid = os.environ.get(parent_var, "")
    if re.fullmatch(r"[0-9]{1,9}", pid) and is_ancestor(int(pid)) and not _WATCHING:
        # one watcher a process (a served client that then runs the command here)
        _WATCHING.append(threading.Thread(target=_watch_parent, args=(int(pid),), daemon=True))
        _WATCHING[0].start()


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_FORKER: list[int] = []


def children_die_with_me() -> None:
    """Every process this one forks from now on (a pool of tokenizing workers) is killed when this one dies, however
    it dies (os._exit after a signal, kill -9): Linux's PR_SET_PDEATHSIG, set in the child just after fork(2), so a
    pool's workers never outlive their owner, and a pool still refilling itself cannot leave new ones behind.
    Elsewhere: nothing."""
    if _FORKER or not hasattr(os, "register_at_fork"):
        return
    _FORKER.append(os.getpid())
    os.register_at_fork(after_in_child=_die_with_parent)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was already gone before the prctl took
        os._exit(128 + signal.SIGKILL)


def is_ancestor(pid: int) -> bool:
    """Is `pid` this process's parent, grandparent, ...? (Linux /proc; elsewhere: no.)"""
    current = os.getppid()
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        if (stat := proc_stat(current)) is None or not re.fullmatch(r"[0-9]+", stat[1]):
            return False
        current = int(stat[1])
    return False


def _watch_parent(pid: int, poll: float = POLL_S) -> None:
    while alive(pid):
        time.sleep(poll)
    os.kill(os.getpid(), signal.SIGTERM)


def alive(pid: int) -> bool:
    """Is `pid` a live process here (a zombie, killed but not yet reaped, is not)?"""
    if pid <= 0:  # os.kill(0 or -1, ...) would address a whole process group or every process
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a pid past the C int, no such process
        return False
    except PermissionError:
        return True
    stat = proc_stat(pid)
    return stat is None or stat[0] != "Z"


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None where it cannot be read (not Linux)."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return None
