"""The plan server's client and its place (the server: launch/serve.py). `forward` hands a checked command that
needs Bridge to this checkout's server, starting one when none runs, with the client's environment, working
directory, umask, resource limits and terminal, and returns its exit status. The command starts only once the
worker said "accepted": a client that never read it runs the command itself (it never started); one that read it
and then lost the server reports that and runs nothing twice. docs/plan.md says when a server is used."""

from __future__ import annotations

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
import subprocess
import sys
import time
from pathlib import Path

from launch.args import Parser
from overlapkit import stack
from overlapkit.errors import BadInput
from overlapkit.secrets import is_secret

ROOT = stack.REPO_ROOT
SWITCH = "OVERLAPKIT_PLAN_SERVER"  # 1: use (and start) one; 0: never; unset: the cluster profile's plan_server
DIR_VAR = "OVERLAPKIT_PLAN_SERVER_DIR"  # default $XDG_RUNTIME_DIR/overlapkit, else /tmp/overlapkit-<uid>
IDLE_VAR = "OVERLAPKIT_PLAN_SERVER_IDLE"  # seconds without a request before it exits (default 900)
# Read by packages at import time: a client whose values differ needs another server (credentials never count).
IMPORT_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "CUDA", "NVTE_", "MEGATRON")
IMPORT_ENV += ("NEMO", "WANDB", "PYTHON", "OMP_", "MKL_", "LD_", "LC_", "LANG", "TRITON", "XDG_CACHE")
LIMITS = sorted(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))
HEADER = struct.Struct("!I")


def wanted(args, environ=os.environ) -> bool:
    """OVERLAPKIT_PLAN_SERVER=1/0 decides; unset, the cluster profile's `plan_server` (CLUSTER=, default local) does.
    Never inside a Slurm job (a nightly's scheduler job): a daemon there outlives nothing useful."""
    if "SLURM_JOB_ID" in environ:
        return False
    if (switch := environ.get(SWITCH, "").strip()) in ("0", "1"):
        return switch == "1"
    from overlapkit.cluster.profiles import load_profile

    try:
        return load_profile(getattr(args, "cluster", "") or environ.get("CLUSTER") or "local").plan_server
    except BadInput:  # the command itself says what is wrong with CLUSTER=
        return False


def directory(environ=os.environ) -> Path:
    """The user's private socket directory, made if missing; BadInput naming the link or the owner otherwise."""
    run_dir = environ.get("XDG_RUNTIME_DIR", "")
    d = Path(environ.get(DIR_VAR) or (Path(run_dir) / "overlapkit" if os.path.isdir(run_dir) else ""))
    d = d if str(d) != "." else Path(f"/tmp/overlapkit-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700, parents=True)
    st, fix = os.lstat(d), f"remove it, or set {DIR_VAR}=<a directory of yours>"
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"{d} is a symbolic link to {os.readlink(d)}, never followed: {fix}")
    if st.st_uid != os.getuid():
        try:
            owner = f"user {pwd.getpwuid(st.st_uid).pw_name}"
        except KeyError:
            owner = f"uid {st.st_uid}"
        raise BadInput(f"{d} belongs to {owner}, not to you: {fix}")
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077:
        raise BadInput(f"{d} is not a directory private to you (mode {st.st_mode & 0o7777:o}): {fix}")
    return d


def paths(d: Path) -> tuple[Path, Path, Path]:
    """(socket, lock, log) of this checkout's server in `d`."""
    base = d / hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
    return base.with_suffix(".sock"), base.with_suffix(".lock"), base.with_suffix(".log")


def stamp(environ) -> str:
    """What the loaded stack depends on that a client can see: interpreter, sys.path, uv.lock, the import-time
    environment (a digest: values are never sent or logged raw). The server also watches its loaded files."""
    env = sorted((k, v) for k, v in environ.items() if k.startswith(IMPORT_ENV) and not is_secret(k))
    lock = (ROOT / "uv.lock").read_bytes() if (ROOT / "uv.lock").is_file() else b""
    parts = (sys.executable, sys.version, sys.path, hashlib.sha1(lock).hexdigest(), env)
    return hashlib.sha1(repr(parts).encode()).hexdigest()


def holder(lock: Path) -> int | None:
    """The pid of the server holding `lock`, or None when none does."""
    with contextlib.suppress(OSError), open(lock, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return int(f.read().split()[0] or 0)
    return None


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def forward(name: str, args) -> int | None:
    """Run the checked command in this checkout's server (started if none runs): its exit status, or None when this
    process must run it (server off, refused, stale, or never started the command)."""
    if not wanted(args):
        return None
    from overlapkit import makewatch

    makewatch.watch_make()  # make killed: this client ends (SIGTERM), so its worker ends too
    mask = os.umask(0)
    os.umask(mask)
    request = {"name": name, "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": mask}
    request |= {"limits": {r: resource.getrlimit(r) for r in LIMITS}, "stamp": stamp(os.environ)}
    request["streams"] = [(s.encoding, s.errors) for s in (sys.stdin, sys.stdout, sys.stderr)]
    try:
        sock, lock, log = paths(directory())
        if (reply := ask(sock, request)) is None and ready(sock, lock, start(lock, log)):
            reply = ask(sock, request)
    except (BadInput, OSError) as exc:
        note(f"plan server not used: {exc}; running in this process")
        return None
    except KeyboardInterrupt:  # Ctrl-C: the closed connection ends the worker
        return 130
    if reply is None:
        note(f"the plan server did not take this command (log: {log}); running in this process")
    if reply is None or "rc" in reply:
        return reply and reply["rc"]
    if "accepted" in reply:  # the command ran, or may have: never run it twice
        note(f"the plan server stopped during this command (log: {log}); see what it left, then run it again")
        return 128 + signal.SIGTERM
    note(f"plan server not used: {reply.get('stale') or reply.get('refused')}; running in this process")
    return None


def ask(sock: Path, request: dict) -> dict | None:
    """The server's last word on `request` ({rc}, {stale}, {refused}, or {accepted} alone when it was lost), or None
    when nothing answers there or it never accepted."""
    if sock.is_symlink():
        raise BadInput(f"{sock} is a symbolic link to {os.readlink(sock)}, never followed: remove it")
    conn, last = socket.socket(socket.AF_UNIX), None
    try:
        conn.connect(str(sock))
        if (uid := struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]) != os.getuid():
            return {"refused": f"the listener on {sock} runs as uid {uid}, not as you: nothing sent"}
        body = pickle.dumps(request)
        socket.send_fds(conn, [HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        for line in conn.makefile("rb"):
            last = pickle.loads(bytes.fromhex(line.decode()))
            if "accepted" not in last:
                return last
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        conn.close()
    return last


def start(lock: Path, log: Path) -> subprocess.Popen | None:
    """A server for this checkout, its own session, its output to `log`; None when one is already starting."""
    if holder(lock) is not None:
        return None
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "launch", "plan-server", "--serve"]
        kw = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": out}
        return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **kw)


def ready(sock: Path, lock: Path, proc: subprocess.Popen | None, timeout: float = 900) -> bool:
    """Wait until the server listens (True), or it has ended (False): the one started here (`proc`), or the one
    holding the lock (another command's, still importing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc.poll() is None if proc else holder(lock) is not None):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(sock))
            return holder(lock) is not None
        time.sleep(0.2)
    return False


def parse(argv):
    p = Parser(prog="make plan-server-stop", description="stop this checkout's plan server (--serve: run it)")
    p.add_argument("--serve", action="store_true", help="run the server (a client starts it)")
    p.add_argument("--stop", action="store_true", help="stop this checkout's server")
    return p.parse_args(argv)


def check(args) -> bool:
    args.paths = paths(directory())
    return False


def run(args) -> int:
    if args.serve:
        from launch import serve

        os._exit(serve.serve())  # no interpreter teardown of torch
    sock, lock, log = args.paths
    if (pid := holder(lock)) is None:
        print("no plan server runs for this checkout")
        return 0
    with contextlib.suppress(ProcessLookupError):  # gone since
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped the plan server (pid {pid}; log {log})" if holder(lock) is None else f"pid {pid} still stopping")
    return 0
