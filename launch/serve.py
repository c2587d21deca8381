"""The plan server (`python -m launch plan-server`, started by a client: launch/plan_server.py). It loads Bridge, then
forks a worker per command (socketserver) that takes the client's terminal (socket.recv_fds), environment, working
directory and umask, says "accepted", runs the command and sends its exit status. docs/plan.md: what it guarantees."""

import ast
import contextlib
import ctypes
import fcntl
import importlib
import os
import pickle
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from pathlib import Path

from launch import commands
from launch.plan_server import ROOT, peer_uid, stamp
from overlapkit import jsonio, stack


def mtime(path: str) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime_ns


class Server(socketserver.ForkingUnixStreamServer):
    timeout = 30  # handle_request() returns after this long idle: handle_timeout() checks idleness and staleness

    def __init__(self, sock: Path, lock_fd: int):
        self.pid, self.lock_fd, self.stamp0 = os.getpid(), lock_fd, stamp(os.environ)  # before Bridge sets any
        stack.import_bridge()  # preloaded: Bridge, what launch/ and recipes/ import (lazy imports too; not themselves)
        files = [*ROOT.glob("launch/*.py"), *ROOT.glob("recipes/*.py")]
        nodes = [node for path in files for node in ast.walk(ast.parse(path.read_bytes()))]
        names = {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        names |= {alias.name for n in nodes if isinstance(n, ast.Import) for alias in n.names}
        with stack.silenced():
            for name in sorted(n for n in names if n.split(".")[0] not in ("recipes", "launch")):
                with contextlib.suppress(Exception):  # a module that imports only in context: the worker's then
                    importlib.import_module(name)
        self.files = {f: mtime(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}
        self.last, self.done = time.monotonic(), ""
        self.idle = float(os.environ.get("OVERLAPKIT_PLAN_SERVER_IDLE") or 900)  # seconds without a command
        sock.unlink(missing_ok=True)  # a dead server's: we hold the lock
        super().__init__(str(sock), Worker)

    def stale(self) -> str:
        changed = next((f for f, t in self.files.items() if mtime(f) != t), None)
        return f"{changed} changed since it was loaded" if changed else ""

    def verify_request(self, request, client_address) -> bool:
        self.last = time.monotonic()
        return peer_uid(request) == os.getuid()

    def handle_timeout(self) -> None:
        super().handle_timeout()  # reaps finished workers
        if self.active_children:  # a command in flight: not idle
            self.last = time.monotonic()
        idle = time.monotonic() - self.last > self.idle
        self.done = f"idle for {self.idle:.0f} s" if idle else self.stale()


class Worker(socketserver.StreamRequestHandler):
    """One request, in the forked child: become the client, say "accepted", run the command, send its status."""

    def handle(self) -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (prctl(2)): ends with the server
        os.close(self.server.lock_fd)  # a held lock means a server lives: a worker never holds it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _, fds, _, _ = socket.recv_fds(self.request, 1, 3)
        if len(fds) != 3:  # a client that only checked that the server listens (`started`)
            return
        req = pickle.load(self.rfile)
        why = "the client's stack differs (interpreter, sys.path, uv.lock, import-time environment or limits)"
        if why := why if req["stamp"] != self.server.stamp0 else self.server.stale():
            self.say(declined=why)
            return os.kill(self.server.pid, signal.SIGTERM)  # the server exits; the next command starts a fresh one
        for target, fd in enumerate(fds):  # become the client
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())  # as Python sets up a terminal's stdout
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.umask(req["umask"])
        tempfile.tempdir = None  # computed again from the client's TMPDIR
        threading.Thread(target=self.watch, daemon=True).start()
        self.say(accepted=os.getpid())
        module = importlib.import_module(commands.COMMANDS[req["name"]].module)
        try:
            getattr(module, "handlers", lambda: None)()
            code = commands.execute(module, req["args"])
        except BaseException:  # a bug: its traceback, as on the plain path
            sys.excepthook(*sys.exc_info())
            code = 1
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        self.say(rc=code)
        os._exit(code)

    def watch(self) -> None:  # the client went away (Ctrl-C, killed, its make killed): end this worker
        with contextlib.suppress(OSError):
            self.request.recv(1)  # the client sends nothing more: this returns once it has gone
        os.kill(os.getpid(), signal.SIGTERM)

    def say(self, **msg) -> None:
        with contextlib.suppress(OSError):
            pickle.dump(msg, self.wfile)


def serve(sock: Path, lock: Path) -> int:
    """The server's main: lock (one server a checkout; the pid in the file), preload, serve until idle or stale."""
    fd = jsonio.open_lock(lock)  # never through a link planted at its name: it would truncate the link's target
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another server holds this checkout
    os.write(fd, f"{os.getpid():<12}".encode())  # over the last server's pid, whole (a pid has at most 7 digits)
    t0, server = time.monotonic(), Server(sock, fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # make plan-server-stop, or a stale request
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: ready in {time.monotonic() - t0:.1f} s", flush=True)
    with contextlib.suppress(SystemExit):  # SIGTERM: stop now (the caller skips the interpreter's teardown of torch)
        while not server.done:
            server.handle_request()
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: exits ({server.done or 'stopped'})", flush=True)
    server.server_close()  # waits for the commands in flight
    return 0
