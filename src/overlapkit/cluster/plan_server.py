"""The plan server's client (`forward`: a command that needs Bridge run by this checkout's server, launch/serve.py),
and what the server shares with it: the socket, lock and log (`paths`), the stamp of a client's stack, the caller's
uid, the idle time. `make plan-server-stop` and the server: launch/plan_server.py, launch/serve.py. What it
guarantees, and when one is used: docs/plan.md, "Fast commands"."""

import contextlib
import fcntl
import hashlib
import os
import pickle
import pwd
import re
import resource
import signal
import socket
import stat
import struct
import sys
import time
from argparse import ArgumentTypeError
from pathlib import Path
from subprocess import DEVNULL, Popen

from overlapkit import jsonio, makewatch, paths
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput
from overlapkit.secrets import is_secret
from overlapkit.spec.runopts import switch

ROOT = paths.REPO_ROOT
SWITCH = "OVERLAPKIT_PLAN_SERVER"  # on (1, yes, ...): use (and start) one; off: never; unset: the cluster profile's
DIR_VAR = "OVERLAPKIT_PLAN_SERVER_DIR"  # default $XDG_RUNTIME_DIR/overlapkit, else /tmp/overlapkit-<uid>
IDLE_VAR = "OVERLAPKIT_PLAN_SERVER_IDLE"  # seconds without a command before the server exits
IDLE_S = 900
# Read by packages at import time: a client whose values differ needs another server (credentials never count, nor
# the Makefile's data variables: TORCH_PROFILE is an argument of the command, read by no package).
IMPORT_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "CUDA", "NVTE_", "MEGATRON")
IMPORT_ENV += ("NEMO", "WANDB", "PYTHON", "OMP_", "MKL_", "LD_", "LC_", "LANG", "TRITON", "XDG_CACHE")
DATA_VARS = "OVERLAPKIT_DATA_VARS"  # the Makefile's DATA_VARS, exported: every one is handed over as an argument
# A client's longest wait for a server to take its command (connect, send, "accepted"); past it the client runs the
# command itself, safely: a worker runs one only on its client's go, after "accepted". The command's own run: its time.
ACCEPT_S = 5.0
START_S = 600  # a new server's Bridge import: 30 s idle, up to 190 s on a shared machine; past this it is passed by


def wanted(args, environ=os.environ) -> bool:
    """OVERLAPKIT_PLAN_SERVER on/off (spec.runopts.switch's words, else BadInput), else the profile's plan_server."""
    typed = environ.get(SWITCH, "")
    try:
        on = switch(typed) if typed.strip() else None
    except ArgumentTypeError as exc:
        raise BadInput(f"{SWITCH}={typed!r}: {exc}; unset, it is the cluster profile's plan_server") from None
    if "SLURM_JOB_ID" in environ:  # never inside a Slurm job: nothing outlives it
        return False
    if on is not None:
        return on
    try:
        return load_profile(getattr(args, "cluster", "") or environ.get("CLUSTER") or "local").plan_server
    except BadInput:  # the command itself says what is wrong with CLUSTER=
        return False


def idle_seconds(environ=os.environ) -> float:
    """OVERLAPKIT_PLAN_SERVER_IDLE: seconds (a plain number > 0), else BadInput (nan never idles out, abc crashed)."""
    typed = environ.get(IDLE_VAR, "")
    if not typed.strip():
        return float(IDLE_S)
    value = float(typed) if re.fullmatch(r"\s*[0-9]{1,9}(\.[0-9]{1,9})?\s*", typed) else 0.0
    if value <= 0:
        raise BadInput(f"{IDLE_VAR}={typed!r}: seconds a server waits for a command, e.g. {IDLE_S}; unset: {IDLE_S}")
    return value


def paths(environ=os.environ) -> tuple[Path, Path, Path]:
    """(socket, lock, log) of this checkout's server, in the user's private directory: BadInput if it is not."""
    run_dir = environ.get("XDG_RUNTIME_DIR", "")
    default = Path(run_dir, "overlapkit") if os.path.isdir(run_dir) else Path(f"/tmp/overlapkit-{os.getuid()}")
    d, fix = Path(environ.get(DIR_VAR) or default), f"remove it, or set {DIR_VAR}=<a directory of yours>"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # not a directory (a file, a link to one): named below
        pass
    except OSError as exc:
        raise BadInput(f"{d} cannot be made ({exc.strerror}): set {DIR_VAR}=<a directory of yours>") from None
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{d} is a symbolic link to {os.readlink(d)}, never followed: {fix}")
    if st.st_uid != os.getuid():
        owner = next((f"user {u.pw_name}" for u in pwd.getpwall() if u.pw_uid == st.st_uid), f"uid {st.st_uid}")
        raise BadInput(f"{d} belongs to {owner}, not to you: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise BadInput(f"{d} is a file, not a directory: {fix}")
    if st.st_mode & 0o077:
        raise BadInput(f"{d} is not a directory private to you (mode {st.st_mode & 0o7777:o}): {fix}")
    base = d / hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
    return base.with_suffix(".sock"), base.with_suffix(".lock"), base.with_suffix(".log")


def stamp(environ) -> dict:
    """Digests of what a client must share with the server: interpreter, sys.path, uv.lock, each import-time variable
    (by name: a mismatch names it, never its value) and the resource limits (sbatch hands them to a job)."""
    ours = set(environ.get(DATA_VARS, "").split())
    env = {k: digest(v) for k, v in environ.items() if k.startswith(IMPORT_ENV) and k not in ours and not is_secret(k)}
    lock = (ROOT / "uv.lock").read_bytes() if (ROOT / "uv.lock").is_file() else b""
    limits = [resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource)) if n.startswith("RLIMIT_")]
    parts = {"interpreter": (sys.executable, sys.version), "sys.path": sys.path, "uv.lock": lock, "limits": limits}
    return {"env": env} | {k: digest(v) for k, v in parts.items()}


def digest(value) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()


def differs(client, server: dict) -> str:
    """What differs between a client's stamp and the server's (the variables by name), or ""."""
    if not isinstance(client, dict) or set(client) != set(server):
        return "the client's stack differs (another version of this checkout's client)"
    parts = [k for k in server if k != "env" and client[k] != server[k]]
    a, b = client["env"], server["env"]
    if names := sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)):
        parts.append("import-time variable" + ("s " if len(names) > 1 else " ") + ", ".join(names[:5]))
    return f"the client's stack differs from the server's ({'; '.join(parts)})" if parts else ""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of `conn`, from the kernel (struct ucred: pid, uid, gid)."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def holder(lock: Path) -> int | None:
    """The pid of the server holding `lock`, or None when none does."""
    with contextlib.suppress(OSError), open(lock, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return int(f.read() or 0)  # 0: held, its pid not yet written
    return None


def forward(name: str, args) -> int | None:
    """The exit status of the checked command run by this checkout's server, or None when this process must run it.
    BadInput for a plan-server variable that is not understood (OVERLAPKIT_PLAN_SERVER, _IDLE)."""
    if not wanted(args):
        return None
    idle_seconds()  # the server reads it after its import: a bad value is answered here, at once
    makewatch.watch_make()  # make killed: this client ends (SIGTERM), so its worker ends too
    mask = os.umask(0)
    os.umask(mask)
    request = dict(name=name, args=args, env=dict(os.environ), cwd=os.getcwd(), umask=mask, stamp=stamp(os.environ))
    try:
        sock, lock, log = paths()
        if (reply := ask(sock, request)) is None and started(sock, lock, log):
            reply = ask(sock, request)
        reply = reply or {"declined": f"it did not take this command (log: {log})"}
    except (BadInput, OSError) as exc:
        reply = {"declined": str(exc)}
    except KeyboardInterrupt:  # Ctrl-C: the closed connection ends the worker
        return 130
    if "accepted" in reply:  # the command ran, or may have: never run it twice
        print(f"note: the plan server stopped during this command (log: {log}); see what it left", file=sys.stderr)
        return 128 + signal.SIGTERM
    if "declined" in reply:
        print(f"note: plan server not used: {reply['declined']}; running in this process", file=sys.stderr)
    return reply.get("rc")


def ask(sock: Path, request: dict) -> dict | None:
    """The server's last word on `request`: {rc}, {declined}, {accepted} when it was lost, None if none listens.
    Connecting, sending and hearing "accepted" take at most ACCEPT_S together, else {declined}; then the client says
    go (a worker never runs a command its client gave up on) and waits for the status."""
    last, deadline = None, time.monotonic() + ACCEPT_S
    with socket.socket(socket.AF_UNIX) as conn, contextlib.suppress(FileNotFoundError, ConnectionError, EOFError):
        try:
            conn.settimeout(ACCEPT_S)
            connect(conn, sock, deadline)
            if (uid := peer_uid(conn)) != os.getuid():  # before a byte is sent: a request holds our environment
                return {"declined": f"the listener on {sock} runs as uid {uid}, not as you: nothing sent"}
            socket.send_fds(conn, [b"\0"], [0, 1, 2])  # our terminal, then the request
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            conn.sendall(pickle.dumps(request))
            replies = conn.makefile("rb")
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            last = pickle.load(replies)
        except TimeoutError:
            pid = holder(sock.with_suffix(".lock"))
            who = f"the plan server (pid {pid})" if pid else "the listener on its socket"
            fix = "stopped or hung? make plan-server-stop ends it"
            return {"declined": f"{who} did not take this command within {ACCEPT_S:g} s ({fix})"}
        if "accepted" in last:
            conn.settimeout(None)  # the command runs: its own time
            conn.sendall(b"go")
            while "accepted" in (last := pickle.load(replies)):
                pass
    return last


def connect(conn: socket.socket, sock: Path, deadline: float) -> None:
    """conn.connect(sock), again while its backlog is full (EAGAIN at once, with a timeout) until `deadline`."""
    while True:
        try:
            return conn.connect(str(sock))
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(0.05)


def started(sock: Path, lock: Path, log: Path) -> bool:
    """Start a server (not watching make: it outlives it), its output to `log`: True once one listens, in START_S."""
    env = {k: v for k, v in os.environ.items() if k != makewatch.MAKE_PID}
    with os.fdopen(jsonio.open_lock(log, append=True), "ab") as out:  # never through a link planted at its name
        argv = [sys.executable, "-m", "launch", "plan-server"]
        proc = Popen(argv, cwd=ROOT, env=env, stdin=DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + START_S
    while (proc.poll() is None or holder(lock) is not None) and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(1)
            probe.connect(str(sock))
            return True
        time.sleep(0.2)
    return False
