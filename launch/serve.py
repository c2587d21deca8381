"""The plan server (`python -m launch plan-server`, started by a client: overlapkit/cluster/plan_server.py). It loads
Bridge, then forks a worker per command (socketserver) that takes the client's terminal (socket.recv_fds),
environment, working directory and umask, says "accepted", runs the command and sends its exit status. docs/plan.md:
what it guarantees."""

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
from overlapkit import jsonio
from overlapkit.bridge import stack
from overlapkit.cluster.plan_server import ROOT, differs, idle_seconds, peer_uid, stamp


def mtime(path: str) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime_ns


def preload() -> dict[str, int | None]:
    """Bridge, and what launch/ and recipes/ import (lazy imports too; not themselves), imported: the loaded files
    with their mtimes (a change makes the server stale)."""
    stack.import_bridge()
    files = [*ROOT.glob("launch/*.py"), *ROOT.glob("recipes/*.py")]
    nodes = [node for path in files for node in ast.walk(ast.parse(path.read_bytes()))]
    names = {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    names |= {alias.name for n in nodes if isinstance(n, ast.Import) for alias in n.names}
    with stack.silenced():
        for name in sorted(n for n in names if n.split(".")[0] not in ("recipes", "launch")):
            with contextlib.suppress(Exception):  # a module that imports only in context: the worker's then
                importlib.import_module(name)
    return {f: mtime(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}


class Server(socketserver.ForkingUnixStreamServer):
    # handle_request() returns after this long without a request: handle_timeout() reaps the workers that ended (a
    # zombie lasts at most this long), and checks idleness, and staleness every STALE_S
    timeout = 0.5
    STALE_S = 30  # a stat of every loaded file (thousands): not twice a second

    def __init__(self, sock: Path, lock_fd: int, idle: float, load=preload):
        self.pid, self.lock_fd, self.stamp0 = os.getpid(), lock_fd, stamp(os.environ)  # before Bridge sets any
        self.files, self.idle = load(), idle
        self.last = self.checked = time.monotonic()
        self.done = ""
        sock.unlink(missing_ok=True)  # a dead server's: we hold the lock
        super().__init__(str(sock), Worker)

    def stale(self) -> str:
        changed = next((f for f, t in self.files.items() if mtime(f) != t), None)
        return f"{changed} changed since it was loaded" if changed else ""

    def verify_request(self, request, client_address) -> bool:
        self.last = time.monotonic()
        return peer_uid(request) == os.getuid()

    def process_request(self, request, client_address) -> None:
        self.collect_children()  # reap the workers that ended; at max_children, wait for one before forking another
        super().process_request(request, client_address)

    def handle_timeout(self) -> None:
        super().handle_timeout()  # reaps finished workers
        now = time.monotonic()
        if self.active_children:  # a command in flight: not idle
            self.last = now
        if now - self.last > self.idle:
            self.done = f"idle for {self.idle:g} s"
        elif now - self.checked >= self.STALE_S:
            self.checked, self.done = now, self.stale()


GO_S = 60  # how long a worker waits for its client's go after "accepted" (the client sends it at once)


class Worker(socketserver.StreamRequestHandler):
    """One request, in the forked child: become the client, say "accepted", hear go, run the command, send its
    status. Until go, each read waits at most GO_S (socketserver sets `timeout` on the connection): a client stopped
    mid-request never holds a worker."""

    timeout = GO_S

    def handle(self) -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (prctl(2)): ends with the server
        os.close(self.server.lock_fd)  # a held lock means a server lives: a worker never holds it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _, fds, _, _ = socket.recv_fds(self.request, 1, 3)
        if len(fds) != 3:  # a client that only checked that the server listens (`started`)
            return
        try:
            req = pickle.load(self.rfile)
        except (EOFError, OSError, pickle.UnpicklingError):  # the client went away (or gave up) mid-request
            return
        if why := differs(req["stamp"], self.server.stamp0) or self.server.stale():
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
        self.say(accepted=os.getpid())
        go = b""
        with contextlib.suppress(OSError):
            go = self.rfile.read(2)
        if go != b"go":  # the client gave up waiting (plan_server.ask) and runs the command itself
            os._exit(0)
        self.request.settimeout(None)
        threading.Thread(target=self.watch, daemon=True).start()
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
    t0, server = time.monotonic(), Server(sock, fd, idle_seconds())  # the idle value checked before the import
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # make plan-server-stop, or a stale request
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: ready in {time.monotonic() - t0:.1f} s", flush=True)
    with contextlib.suppress(SystemExit):  # SIGTERM: stop now (the caller skips the interpreter's teardown of torch)
        while not server.done:
            server.handle_request()
    print(f"{time.strftime('%F %T')} pid {os.getpid()}: exits ({server.done or 'stopped'})", flush=True)
    server.server_close()  # waits for the commands in flight
    return 0
