"""The plan server (`python -m launch plan-server --serve`, which a client starts: launch/plan_server.py): it
imports Bridge, the command modules and the third-party modules they and the recipe files name, then forks a worker
per request (socketserver.ForkingUnixStreamServer), which becomes the client (socket.recv_fds: its terminal), says
"accepted", runs the command through the dispatcher's `execute` and sends the exit status. A worker imports
recipes/ (and what else is not loaded) fresh from disk; nothing of ours is imported twice in a process: the loaded
files are watched, and a change, or a client of another stack, stops the server. A worker dies with its server
(PR_SET_PDEATHSIG) and with its client (the connection closes). Idle for OVERLAPKIT_PLAN_SERVER_IDLE s (900): exit."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import fcntl
import importlib
import os
import pickle
import resource
import signal
import socket
import socketserver
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from launch import commands
from launch.plan_server import HEADER, IDLE_VAR, ROOT, directory, paths, stamp
from overlapkit import jsonio, stack
from overlapkit.errors import BadInput

PR_SET_PDEATHSIG = 1  # prctl(2)


def preload() -> dict[str, tuple]:
    """Bridge, the command modules, and every module the command modules and the recipe files name (their lazy
    imports too; recipes/ itself stays unloaded). Returns the loaded files with their (mtime, size)."""
    stack.import_bridge()
    names = {c.module for c in commands.COMMANDS.values()}
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
    fd = jsonio.open_lock(lock)  # never through a link planted at its name: it would truncate the link's target
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server holds this checkout
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    pid = os.getpid()  # the lock is the server's alone (held means a server lives): its children close their copy
    os.register_at_fork(after_in_child=lambda: os.getppid() == pid and os.close(fd))
    t0, stamp0 = time.monotonic(), stamp(os.environ)
    server = Server(sock, stamp0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # make plan-server-stop, or a stale request
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: ready in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        while not server.done:
            server.handle_request()
    except SystemExit:  # SIGTERM: stop now (the caller exits without the interpreter's teardown of torch)
        server.done = server.done or "stopped"
    finally:
        print(f"{time.strftime('%F %T')} pid {os.getpid()}: exits ({server.done or 'stopped'})", flush=True)
        with contextlib.suppress(OSError):
            sock.unlink()
        server.server_close()  # waits for the commands in flight
    return 0
