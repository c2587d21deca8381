"""Where a checkout's plan server lives, and the stamp that says whether its loaded stack is current (the
client computes it from its own environment, the server from the one it started with)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import site
import socket
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from overlapkit import stack
from overlapkit.secrets import is_secret

ROOT = stack.REPO_ROOT
SWITCH = "OVERLAPKIT_PLAN_SERVER"  # 0/off/false/no: plan in this process, start nothing
DIR_VAR = "OVERLAPKIT_PLAN_SERVER_DIR"  # socket directory (default $XDG_RUNTIME_DIR/overlapkit, /tmp/overlapkit-<uid>)
IDLE_VAR = "OVERLAPKIT_PLAN_SERVER_IDLE"  # seconds without a request before it exits
SALT_VAR = "OVERLAPKIT_PLAN_SERVER_STAMP"  # test hook: mixed into the stamp, as a changed venv would be
IDLE_S = 15 * 60
OURS = ("overlapkit", "recipes", "launch")  # top-level packages whose modules every plan imports fresh
# The commands served, by module: each pays the Bridge import on its plain path. The worker calls the module's
# `cli(argv)`, exactly what its `python -m` entry calls; a request naming any other module is refused.
SERVED = ("launch.plan", "launch.new_recipe", "launch.submit", "launch.nightly", "launch.overlap_report")
# Imported by the probe after its plans: the submission stack (nemo_run, Bridge's run plugins) that served submit,
# sbatch and nightly commands would otherwise import in every worker.
SUBMITTING = ("nemo_run", "megatron.bridge.recipes.run_plugins", "launch.submit", "launch.nightly")
# The files of ours that run in the server itself (before and around the import): an edit restarts it.
SERVER_SOURCES = [
    *(ROOT / "src/overlapkit" / f for f in ("__init__.py", "stack.py", "te_stub.py", "lazy_imports.py")),
    *(ROOT / "src/overlapkit/serve" / f for f in ("__init__.py", "paths.py", "client.py", "server.py")),
    ROOT / "src/overlapkit/secrets.py",  # is_secret, which the stamp reads
    ROOT / "launch/__init__.py",
    ROOT / "launch/plan_server.py",
]
# Environment variables that packages read at import time (HF cache and offline mode, torch and CUDA settings,
# sys.path, locale): a client whose values differ gets a new server rather than constants from another shell.
# NCCL_* is not among them: NCCL reads it when a communicator is created, in a job, never at import (and the worker
# runs with the client's environment). Nor is a credential (HF_TOKEN, WANDB_API_KEY: `is_secret` below): read when
# used, from the client's environment, and a token in one shell must not restart the server for every other.
ENV_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVTE_",
    "MEGATRON",
    "NEMO",
    "WANDB",
    "PYTHON",
    "OMP_",
    "MKL_",
    "LD_",
    "LC_",
    "LANG",
    "TRITON",
    "XDG_CACHE",
    SALT_VAR,
)
HEADER = struct.Struct("!I")
# This process's environment and sys.path as it started (before a command here sets NEMORUN_HOME, or Bridge's import
# appends to sys.path): what a client computes its stamp from, and so what a process that becomes the server after
# its own command (become_server) must be stamped with.
ENV_AT_START, PATH_AT_START = dict(os.environ), list(sys.path)


# --- where a checkout's server lives -------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    """Socket, lock (holding the pid and state), log and start-failure record of one checkout's server."""

    dir: Path
    base: str

    @classmethod
    def of(cls, root: Path = ROOT, environ=None) -> Paths:
        env = os.environ if environ is None else environ
        if env.get(DIR_VAR):
            d = Path(env[DIR_VAR])
        elif env.get("XDG_RUNTIME_DIR") and Path(env["XDG_RUNTIME_DIR"]).is_dir():
            d = Path(env["XDG_RUNTIME_DIR"]) / "overlapkit"
        else:
            d = Path("/tmp") / f"overlapkit-{os.getuid()}"  # fixed, not $TMPDIR: one server per checkout
        return cls(d, hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12])

    @property
    def sock(self) -> Path:
        return self.dir / f"{self.base}.sock"

    @property
    def lock(self) -> Path:
        return self.dir / f"{self.base}.lock"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.base}.log"

    @property
    def failed(self) -> Path:
        return self.dir / f"{self.base}.failed"

    def private(self) -> Paths:
        """Create the directory (0700) and refuse one that another user could write to or own."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.dir)
        if not os.path.isdir(self.dir) or os.path.islink(self.dir) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"{self.dir} is not a directory private to you (mode {st.st_mode & 0o777:o}): remove it")
        return self


# --- the stamp: what makes a preloaded stack current -----------------------------------------------------------


def _file_id(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def stamp(environ, path=None, root: Path = ROOT) -> dict[str, str]:
    """What the preloaded stack depends on, part by part, as computed by the client (its environment and sys.path)
    and by the server (those it started with: importing Bridge appends to sys.path). Equal stamps mean the same
    interpreter, venv, lock, server files and import-time environment. Reads the real files every time (about a
    millisecond). Values are digests: the environment's values (a token, maybe) are never logged or compared raw."""
    parts = {"python": repr((sys.executable, sys.version, sys.prefix)), "sys.path": repr(path or sys.path)}
    parts["uv.lock"] = str(_digest(root / "uv.lock"))
    for p in [Path(sys.prefix) / "pyvenv.cfg", *map(Path, site.getsitepackages())]:
        parts[str(p)] = repr(_file_id(p))
    parts.update({stack.repo_relative(p): str(_digest(p)) for p in SERVER_SOURCES})
    for key, value in environ.items():
        if key.startswith(ENV_PREFIXES) and not is_secret(key):
            parts[f"${key}"] = hashlib.sha1(value.encode(errors="replace")).hexdigest()[:16]
    return parts


def differences(a: dict, b: dict) -> str:
    """The parts two stamps disagree on, named (at most five), '' when equal."""
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha1(path.read_bytes()).hexdigest()
    except OSError:
        return None


def loaded_files() -> dict[str, tuple | None]:
    """mtime and size of every file a loaded module came from (a few thousand stats, a few ms)."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in OURS:  # imported fresh by every worker; the stamp covers the server's own files
            continue
        origin = getattr(getattr(mod, "__spec__", None), "origin", None)
        if isinstance(origin, str) and os.path.isabs(origin):
            out[origin] = _file_id(Path(origin))
    return out


# What lstat says is at the socket path, for the one line that says why it is not connected to.
_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO"}


def socket_problem(paths: Paths) -> str | None:
    """Why the socket path is not one to connect to or replace: None when a socket is there (or nothing yet). Seen
    with lstat, so a symbolic link is never followed; whatever else is there is left as it is (a server replaces only
    a socket, a dead server's: it is not ours to remove a file someone put there)."""
    try:
        mode = os.lstat(paths.sock).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{paths.sock}: {exc.strerror}"
    if stat.S_ISSOCK(mode):
        return None
    what = "a symbolic link (never followed)" if stat.S_ISLNK(mode) else _KINDS.get(stat.S_IFMT(mode), "a file")
    return f"{paths.sock} is {what}, not the server's socket; left as it is: remove it, and a server starts again"


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (unix(7))


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix socket (SO_PEERCRED): the listener's
    for a client, the connecting process's for the server."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_problem(paths: Paths, sock: socket.socket) -> str | None:
    """Why the listener a connected `sock` reached is not this checkout's server, or None: its uid must be ours and
    its pid the one the server wrote into its lock (SO_PEERCRED: the process that called listen(), unix(7)). Checked
    before a byte is sent: a request carries the whole environment, tokens included."""
    pid, uid, _ = peer_cred(sock)
    if uid != os.getuid():
        return f"the listener on {paths.sock} runs as uid {uid}, not as you"
    held = holder(paths)
    if held is None or held[0] != pid:
        whose = f"the server holding {paths.lock} is pid {held[0]}" if held else f"no server holds {paths.lock}"
        return f"the listener on {paths.sock} is pid {pid}, and {whose}"
    return None


def holder(paths: Paths) -> tuple[int, str] | None:
    """(pid, state) of the server holding this checkout's lock, or None when none does."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it
    except BlockingIOError:
        pid, _, state = os.pread(fd, 100, 0).decode(errors="replace").partition(" ")
        return (int(pid), state.strip()) if pid.isdigit() else (0, "starting")
    finally:
        os.close(fd)
