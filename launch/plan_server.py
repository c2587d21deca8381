"""The plan server's client (`forward`: a command that needs Bridge run by this checkout's server, launch/serve.py)
and `make plan-server-stop`. What it guarantees, and when one is used: docs/plan.md, "Fast commands"."""

import contextlib
import fcntl
import hashlib
import os
import pickle
import pwd
import resource
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path
from subprocess import DEVNULL, Popen

from launch.args import Parser
from overlapkit import jsonio, makewatch, stack
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput
from overlapkit.secrets import is_secret

ROOT = stack.REPO_ROOT
SWITCH = "OVERLAPKIT_PLAN_SERVER"  # 1: use (and start) one; 0: never; unset: the cluster profile's plan_server
DIR_VAR = "OVERLAPKIT_PLAN_SERVER_DIR"  # default $XDG_RUNTIME_DIR/overlapkit, else /tmp/overlapkit-<uid>
# Read by packages at import time: a client whose values differ needs another server (credentials never count).
IMPORT_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "CUDA", "NVTE_", "MEGATRON")
IMPORT_ENV += ("NEMO", "WANDB", "PYTHON", "OMP_", "MKL_", "LD_", "LC_", "LANG", "TRITON", "XDG_CACHE")


def wanted(args, environ=os.environ) -> bool:
    """OVERLAPKIT_PLAN_SERVER=1/0 decides, else the cluster profile's `plan_server`; never inside a Slurm job."""
    switch = "0" if "SLURM_JOB_ID" in environ else environ.get(SWITCH, "").strip()  # a job: nothing outlives it
    if switch in ("0", "1"):
        return switch == "1"
    try:
        return load_profile(getattr(args, "cluster", "") or environ.get("CLUSTER") or "local").plan_server
    except BadInput:  # the command itself says what is wrong with CLUSTER=
        return False


def paths(environ=os.environ) -> tuple[Path, Path, Path]:
    """(socket, lock, log) of this checkout's server, in the user's private directory: BadInput if it is not."""
    run_dir = environ.get("XDG_RUNTIME_DIR", "")
    default = Path(run_dir, "overlapkit") if os.path.isdir(run_dir) else Path(f"/tmp/overlapkit-{os.getuid()}")
    d = Path(environ.get(DIR_VAR) or default)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st, fix = os.lstat(d), f"remove it, or set {DIR_VAR}=<a directory of yours>"
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{d} is a symbolic link to {os.readlink(d)}, never followed: {fix}")
    if st.st_uid != os.getuid():
        owner = next((f"user {u.pw_name}" for u in pwd.getpwall() if u.pw_uid == st.st_uid), f"uid {st.st_uid}")
        raise BadInput(f"{d} belongs to {owner}, not to you: {fix}")
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077:
        raise BadInput(f"{d} is not a directory private to you (mode {st.st_mode & 0o7777:o}): {fix}")
    base = d / hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
    return base.with_suffix(".sock"), base.with_suffix(".lock"), base.with_suffix(".log")


def stamp(environ) -> str:
    """A digest of what a client shares with the server: interpreter, sys.path, uv.lock, the import-time environment
    and the resource limits (sbatch hands them to a job). The server also watches its loaded files."""
    env = sorted((k, v) for k, v in environ.items() if k.startswith(IMPORT_ENV) and not is_secret(k))
    lock = (ROOT / "uv.lock").read_bytes() if (ROOT / "uv.lock").is_file() else b""
    limits = [resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource)) if n.startswith("RLIMIT_")]
    return hashlib.sha1(repr((sys.executable, sys.version, sys.path, lock, env, limits)).encode()).hexdigest()


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
    """The exit status of the checked command run by this checkout's server, or None when this process must run it."""
    if not wanted(args):
        return None
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
    """The server's last word on `request`: {rc}, {declined}, {accepted} when it was lost, None if it never accepted."""
    last = None
    with socket.socket(socket.AF_UNIX) as conn, contextlib.suppress(FileNotFoundError, ConnectionError, EOFError):
        conn.connect(str(sock))
        if (uid := peer_uid(conn)) != os.getuid():  # before a byte is sent: a request holds our environment
            return {"declined": f"the listener on {sock} runs as uid {uid}, not as you: nothing sent"}
        socket.send_fds(conn, [b"\0"], [0, 1, 2])  # our terminal, then the request
        conn.sendall(pickle.dumps(request))
        replies = conn.makefile("rb")
        while "accepted" in (last := pickle.load(replies)):
            pass
    return last


def started(sock: Path, lock: Path, log: Path) -> bool:
    """Start a server, its output to `log`: True once it, or one already holding the lock, listens; else False."""
    with os.fdopen(jsonio.open_lock(log, append=True), "ab") as out:  # never through a link planted at its name
        argv = [sys.executable, "-m", "launch", "plan-server"]
        proc = Popen(argv, cwd=ROOT, stdin=DEVNULL, stdout=out, stderr=out, start_new_session=True)
    while proc.poll() is None or holder(lock) is not None:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(sock))
            return True
        time.sleep(0.2)
    return False


def parse(argv):
    p = Parser(prog="make plan-server-stop", description="run this checkout's plan server (a client does), or stop it")
    p.add_argument("action", choices=("serve", "stop"))
    return p.parse_args(argv)


def check(args) -> bool:
    return False


def run(args) -> int:
    sock, lock, log = paths()
    if args.action == "serve":
        from launch import serve

        os._exit(serve.serve(sock, lock))  # no interpreter teardown of torch
    if not (pid := holder(lock)):
        print("no plan server runs for this checkout")
        return 0
    with contextlib.suppress(ProcessLookupError):  # gone since
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped the plan server (pid {pid}; log {log})" if holder(lock) is None else f"pid {pid} still stopping")
    return 0
