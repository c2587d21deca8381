"""The plan server: one process per user and checkout that keeps torch and Megatron Bridge loaded, so a command
that needs them (launch/commands.py: `check` said so) runs in about a second instead of paying the import.

The standard library does the work: socketserver.ForkingUnixStreamServer forks one worker per request (and reaps
it), socket.send_fds hands over the client's stdin/stdout/stderr. A worker becomes the client (its checked
arguments, environment, working directory, umask, resource limits and terminal), runs the command's `run` through
the dispatcher's `execute`, and sends its exit status back. The server imported Bridge, the command modules and
the third-party modules they and the recipe files name (preload); recipes/ and whatever else a command imports
lazily are imported by the worker itself, fresh from disk, so an edited recipe shows in the next command. Nothing
of ours is ever imported twice in one process: what the server loaded is watched instead (stale()).

A worker dies with its server (PR_SET_PDEATHSIG) and with its client (the connection closes: SIGTERM), so kill -9
of either, or of make (the client watches make, overlapkit/makewatch.py), leaves nothing running. A command is
started only after the worker has said "accepted": a client that never read it runs the command itself (it never
started); one that read it and then lost the server reports that and runs nothing again (a plan may have written
its run directory, a submission may have reached Slurm). docs/plan.md says when a server is used.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import fcntl
import hashlib
import importlib
import os
import pickle
import pwd
import resource
import signal
import socket
import socketserver
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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
PR_SET_PDEATHSIG = 1  # prctl(2)


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


# --- the client --------------------------------------------------------------------------------------------------


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


# --- the server --------------------------------------------------------------------------------------------------


def preload() -> dict[str, tuple]:
    """Bridge, the command modules, and every module the command modules and the recipe files name (their lazy
    imports too; recipes/ itself stays unloaded). Returns the loaded files with their (mtime, size)."""
    from launch.commands import COMMANDS

    stack.import_bridge()
    names = {c.module for c in COMMANDS.values()}
    for path in [*ROOT.glob("launch/*.py"), *ROOT.glob("recipes/*.py")]:
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    with stack.silenced():
        for name in sorted(n for n in names if n.split(".")[0] not in ("recipes", "launch")):
            with contextlib.suppress(Exception):  # a module that imports only in context: the worker's then
                importlib.import_module(name)
    return {f: file_id(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}


def file_id(path: str) -> tuple | None:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return st.st_mtime_ns, st.st_size
    return None


class Server(socketserver.ForkingUnixStreamServer):
    timeout = 30  # handle_request() returns after this long idle: handle_timeout() checks idleness and staleness

    def __init__(self, sock: Path, stamp0: str):
        self.pid, self.stamp0, self.files, self.last, self.done = os.getpid(), stamp0, preload(), time.monotonic(), ""
        self.idle = float(os.environ.get(IDLE_VAR) or 900)
        if sock.exists() or sock.is_symlink():
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):  # a file or link put there: not ours to remove
                raise BadInput(f"{sock} is not a socket: left as it is, remove it")
            sock.unlink()  # a dead server's: we hold the lock
        super().__init__(str(sock), Worker)

    def stale(self) -> str:
        changed = next((f for f, fid in self.files.items() if file_id(f) != fid), None)
        return f"{changed} changed since it was loaded" if changed else ""

    def verify_request(self, request, client_address) -> bool:
        return struct.unpack("3i", request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1] == os.getuid()

    def handle_timeout(self) -> None:
        super().handle_timeout()  # reaps finished workers
        if self.active_children:
            self.last = time.monotonic()
        elif time.monotonic() - self.last > self.idle:
            self.done = f"idle for {self.idle:.0f} s"
        else:
            self.done = self.stale()


class Worker(socketserver.BaseRequestHandler):
    """One request, in the forked child: become the client, say "accepted", run the command, send its status."""

    def handle(self) -> None:
        server, conn = self.server, self.request
        if sys.platform == "linux":
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != server.pid:  # the server died before the line above: no one would end this worker
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        data, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        if len(data) < HEADER.size:  # a client that only checked the server listens (ready())
            return
        body = b""
        while len(body) < HEADER.unpack(data)[0] and (chunk := conn.recv(1 << 20)):
            body += chunk
        req = pickle.loads(body)
        why = "the client's stack differs (interpreter, sys.path, uv.lock or import-time environment)"
        if (why := (why if req["stamp"] != server.stamp0 else server.stale())) or len(fds) != 3:
            self.say(stale=why or "no terminal received")
            return os.kill(os.getppid(), signal.SIGTERM)  # the server exits; the next command starts a fresh one
        try:
            for r, (soft, hard) in req["limits"].items():
                resource.setrlimit(r, (soft, hard))
        except (ValueError, OSError) as exc:
            return self.say(refused=f"the client's resource limits are above the server's ({exc})")
        self.become(req, fds)
        threading.Thread(target=self.watch, daemon=True).start()
        self.say(accepted=os.getpid())
        from launch import commands

        module = importlib.import_module(commands.COMMANDS[req["name"]].module)
        code = 1
        try:
            if handlers := getattr(module, "handlers", None):
                handlers()
            code = commands.execute(module, req["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # a bug: its traceback, as on the plain path
            traceback.print_exc()
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                s.flush()
        self.say(rc=code)
        os._exit(code)

    def become(self, req: dict, fds: list[int]) -> None:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for (enc, errors), fd, name in zip(req["streams"], (0, 1, 2), ("stdin", "stdout", "stderr"), strict=True):
            mode = "r" if fd == 0 else "w"
            stream = open(fd, mode, buffering=1 if os.isatty(fd) else -1, encoding=enc, errors=errors, closefd=False)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.umask(req["umask"])
        tempfile.tempdir = None  # computed again from the client's TMPDIR
        time.tzset()

    def watch(self) -> None:
        """The client went away (Ctrl-C, killed, its make killed): end this worker."""
        with contextlib.suppress(OSError):
            while self.request.recv(1):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    def say(self, **msg) -> None:
        with contextlib.suppress(OSError):
            self.request.sendall(pickle.dumps(msg).hex().encode() + b"\n")


def serve() -> int:
    """The server's main (`python -m launch plan-server --serve`, started by a client): lock, preload, serve."""
    sock, lock, log = paths(directory())
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server holds this checkout
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    t0, stamp0 = time.monotonic(), stamp(os.environ)
    server = Server(sock, stamp0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # make plan-server-stop, or a stale request
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: ready in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        while not server.done:
            server.handle_request()
    finally:
        print(f"{time.strftime('%F %T')} pid {os.getpid()}: exits ({server.done or 'stopped'})", flush=True)
        with contextlib.suppress(OSError):
            sock.unlink()
        server.server_close()  # waits for the commands in flight
    return 0


# --- `python -m launch plan-server --serve | --stop | --status` (make plan-server-stop) ---------------------------


def parse(argv):
    p = Parser(prog="make plan-server-stop", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    for flag, why in (("serve", "run the server"), ("stop", "stop this checkout's"), ("status", "its pid, if any")):
        g.add_argument(f"--{flag}", action="store_true", help=why)
    return p.parse_args(argv)


def check(args) -> bool:
    args.paths = paths(directory())
    return False


def run(args) -> int:
    sock, lock, log = args.paths
    if args.serve:
        os._exit(serve())  # no interpreter teardown of torch
    pid = holder(lock)
    if args.status or pid is None:
        print(f"plan server pid {pid} ({sock}; log {log})" if pid else "no plan server runs for this checkout")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped the plan server (pid {pid})" if holder(lock) is None else f"plan server pid {pid} still stopping")
    return 0
