"""The plan server itself: one process per user and checkout that keeps Bridge loaded and forks a worker per
command (overlapkit/serve/__init__.py says how it all works)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import io
import json
import linecache
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import stack
from overlapkit.serve.paths import (
    HEADER,
    IDLE_S,
    IDLE_VAR,
    OURS,
    ROOT,
    SERVED,
    SUBMITTING,
    SWITCH,
    Paths,
    _file_id,
    differences,
    holder,
    loaded_files,
    peer_cred,
    socket_problem,
    stamp,
)

# --- the server --------------------------------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {text}", file=sys.stderr, flush=True)


def _take_lock(paths: Paths) -> int | None:
    """The lock fd (held for the server's life), or None when a live server holds it. A server that is stopping
    (stale) is waited for, so the one its client just started takes over."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + 60
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            held = holder(paths)
            if (held and held[1] != "stopping") or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


def _set_state(fd: int, state: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {state}".encode(), 0)


def probe_modules(close=(), timeout: float = 300) -> list[str]:
    """Names of the third-party modules planning imports lazily, in import order: a child plans every recipe (and
    renders and writes one plan) with our code and reports sys.modules. Empty when the probe fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe child: never returns
        os.close(r)
        code = 1
        try:
            for fd in close:
                os.close(fd)  # the server's lock: held by the server alone
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            plan = importlib.import_module("launch.plan")
            with tempfile.TemporaryDirectory() as runs:
                plan.main(["--list"])
                first = importlib.import_module("overlapkit.plan.registry").names()[0]
                plan.main([first, "--runs", runs])
            for name in SUBMITTING:  # what a served submit, sbatch or nightly imports after planning
                importlib.import_module(name)
            names = [n for n, m in list(sys.modules.items()) if _third_party(n, m)]
            os.write(w, json.dumps(names).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # done or timed out
    os.waitpid(pid, 0)
    try:
        return json.loads(data)
    except ValueError:
        return []


def _third_party(name: str, module) -> bool:
    """A module loaded from a real file or built in, not ours (placeholders and dynamic modules have no origin)."""
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    real = isinstance(origin, str) and (os.path.isabs(origin) or origin in ("built-in", "frozen"))
    return real and name.split(".")[0] not in OURS and not name.startswith("__")


def preload(lock: int) -> None:
    """torch + Bridge, then what planning imports lazily (by name: no plan runs in the server)."""
    t0 = time.monotonic()
    stack.import_bridge()
    log(f"imported Megatron Bridge in {time.monotonic() - t0:.1f} s")
    t1 = time.monotonic()
    names = [n for n in probe_modules(close=(lock,)) if n not in sys.modules]
    failed = 0
    with stack.silenced():
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # a module that only imports in context: the plan will import it itself
                failed += 1
    log(f"preloaded {len(names) - failed} more modules ({failed} left to the plans) in {time.monotonic() - t1:.1f} s")


@dataclass
class Server:
    """The serving loop and its state: one process, no threads (workers are forked, so the loop must never hold a
    lock a thread could be holding); a SIGCHLD wakes it through a pipe, so an exit status is reported at once."""

    paths: Paths
    lock: int
    env0: dict  # the environment and sys.path it started with (the client's that started it)
    path0: list
    stamp0: dict
    files: dict
    listener: socket.socket | None = None
    sock_ino: int = 0
    terminated: bool = False  # SIGTERM (make plan-server-stop): finish the plans in flight, then exit
    served: int = 0
    wake: tuple[int, int] | None = None
    workers: dict | None = None  # worker pid → client connection
    pending: dict = field(default_factory=dict)  # connection → Pending: a request still arriving
    stale: str = ""
    last: float = 0.0

    def why_stale(self, client_stamp: dict | None = None) -> str:
        """'' when the preloaded stack is current; else what changed (names, never values)."""
        if client_stamp is not None and (diff := differences(client_stamp, self.stamp0)):
            return f"the client differs in {diff}"
        if diff := differences(stamp(self.env0, self.path0), self.stamp0):
            return f"changed since the server started: {diff}"
        if self.listener is not None and _inode(self.paths.sock) != self.sock_ino:  # no client can reach it now
            return f"its socket {self.paths.sock} was removed or replaced"
        changed = next((f for f, fid in self.files.items() if _file_id(Path(f)) != fid), None)
        return f"{changed} changed since it was loaded" if changed else ""

    def reply(self, conn: socket.socket, **msg) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(msg).encode() + b"\n")

    def stop_listening(self, why: str) -> None:
        """Stale: refuse new requests, let the plans in flight finish, then exit (the loop sees no listener)."""
        self.stale = why
        _set_state(self.lock, "stopping")
        self.close_listener()
        log(f"stopping: {why}")

    def close_listener(self) -> None:
        if self.listener is not None:
            if _inode(self.paths.sock) == self.sock_ino:  # ours still: never what replaced it
                with contextlib.suppress(OSError):
                    os.unlink(self.paths.sock)
            self.listener.close()
            self.listener = None

    def bind(self) -> None:
        if problem := socket_problem(self.paths):  # a file, a link: not ours to remove
            raise OSError(problem)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.paths.sock)  # a dead server's socket: we hold the lock, so no live one owns it
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.paths.sock))
        os.chmod(self.paths.sock, 0o600)
        self.sock_ino = _inode(self.paths.sock)
        self.listener.listen(64)
        self.listener.setblocking(False)

    def loop(self) -> int:
        """Accept requests, fork workers, report their exit status; exit when stale and idle, or idle too long."""
        self.workers, self.last = {}, time.monotonic()
        idle = float(os.environ[IDLE_VAR]) if os.environ.get(IDLE_VAR, "").isdigit() else IDLE_S
        checked = time.monotonic()
        while self.listener is not None or self.workers:
            conns = list(self.workers.values())
            waiting = [*filter(None, [self.listener]), self.wake[0], *conns, *self.pending]
            ready = select.select(waiting, [], [], 1.0 if self.pending else 5.0)[0]
            if self.wake[0] in ready:
                os.read(self.wake[0], 4096)
            self.reap()
            if self.terminated and self.listener is not None:
                self.stop_listening("stopped (SIGTERM)")
            for conn in [c for c in ready if c in conns]:
                self.client_gone(conn)
            for conn in [c for c in ready if c in self.pending]:
                self.read(conn)
            self.expire()
            if self.listener is not None and self.listener in ready:
                self.accept()
            now = time.monotonic()
            if self.listener is not None and not self.workers and now - self.last > idle:
                self.stop_listening(f"idle for {idle:.0f} s")
            elif self.listener is not None and not self.workers and now - checked > 60:
                checked = now
                if why := self.why_stale():
                    self.stop_listening(why)
        return 0

    def reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                self.reply(conn, rc=code if code >= 0 else 128 - code)  # killed by signal N: 128+N, as a shell says
                conn.close()
                self.last = time.monotonic()

    def client_gone(self, conn: socket.socket) -> None:
        """The client closed its end (Ctrl-C, killed): stop its plan, which writes to a terminal nobody reads."""
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_PEEK):
                return
        for pid, c in list(self.workers.items()):
            if c is conn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def accept(self) -> None:
        """A new connection: the caller's uid is checked before a byte of it is read; its request is then read as it
        arrives (read()), so a client that sends nothing stalls nobody."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        uid = peer_cred(conn)[1]
        if uid != os.getuid():
            return self._refuse(conn, f"uid {uid} is not the server's owner")
        conn.setblocking(False)
        self.pending[conn] = Pending(deadline=time.monotonic() + READ_S)

    def read(self, conn: socket.socket) -> None:
        """More of a pending request; once whole, it is handled. A request cut short, too large or bad is dropped."""
        p = self.pending[conn]
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, fds = b"", []
            log(f"bad request: {exc}")
        p.fds += fds
        p.data += data
        bad = not data  # the client closed (or failed) before its request was whole
        try:
            request = p.request()
        except ValueError as exc:
            request, bad = None, True
            log(f"bad request: {exc}")
        if request is None and not bad:
            return  # not all here yet (expire() drops it at its deadline)
        del self.pending[conn]
        try:
            if request is not None:
                conn.setblocking(True)
                self.handle(conn, request, p.fds)
            else:
                conn.close()
        finally:
            for fd in p.fds:
                os.close(fd)

    def expire(self) -> None:
        for conn, p in list(self.pending.items()):
            if time.monotonic() > p.deadline:
                log(f"dropped a client that sent no whole request in {READ_S:.0f} s")
                del self.pending[conn]
                for fd in p.fds:
                    os.close(fd)
                conn.close()

    def handle(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        self.last = time.monotonic()
        if request.get("op") == "ping":
            self.reply(conn, pong=os.getpid(), served=self.served)
            return conn.close()
        if request.get("root") != str(ROOT):
            return self._refuse(conn, f"this server plans {ROOT}, not {request.get('root')}")
        if request.get("module") not in SERVED:
            return self._refuse(conn, f"{request.get('module')!r} is not a served command")
        if why := self.why_stale(request.get("stamp")):
            self.stop_listening(why)  # first: the client starts the next server, which waits for a stopping one
            self.reply(conn, stale=why)
            return conn.close()
        if len(fds) != 3:
            return self._refuse(conn, f"expected 3 file descriptors, got {len(fds)}")
        for s in (sys.stdout, sys.stderr):
            s.flush()  # nothing of the server's log may reach the client's terminal through the worker
        if (threads := threading.active_count()) > 1:  # a fork copies one thread, and any lock another holds
            self.stop_listening(f"{threads} threads in the server: it forks workers only when it has one")
            return self._refuse(conn, "the server is not single-threaded")
        pid = os.fork()
        if pid == 0:
            self.run_worker(conn, request, fds)  # never returns
        self.workers[pid] = conn
        self.served += 1
        self.reply(conn, accepted=pid)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        log(f"refused: {why}")
        self.reply(conn, refused=why)
        conn.close()

    def run_worker(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        code = 1
        try:
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.set_wakeup_fd(-1)
            for fd in (self.lock, *self.wake):
                os.close(fd)
            self.listener.close()
            for c in (*self.workers.values(), conn):
                c.close()
            code = worker(request, fds)
        except BaseException as exc:  # becoming the client failed (its cwd is gone, say): one line, not a traceback
            with contextlib.suppress(OSError):
                os.write(
                    2,
                    f"error: the plan server could not run this plan ({type(exc).__name__}: {exc}); "
                    f"{SWITCH}=0 plans without it\n".encode(errors="replace"),
                )
        finally:
            os._exit(code)


def _inode(path: Path) -> int | None:
    """The inode at `path` itself (lstat: a link put there is not its target), None when nothing is there."""
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


READ_S = 10.0  # a client sends its request at once: one that has not in this long is dropped
MAX_REQUEST = 64 << 20  # argv and environment: a megabyte is a lot; more is not a client of ours


@dataclass
class Pending:
    """A request as it arrives: HEADER (the body's length), the JSON body, and the client's three descriptors."""

    deadline: float
    data: bytearray = field(default_factory=bytearray)
    fds: list = field(default_factory=list)

    def request(self) -> dict | None:
        """The request once it is all here, else None; ValueError when it cannot be one."""
        if len(self.data) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.data)
        if size > MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes")
        if len(self.data) < HEADER.size + size:
            return None
        return json.loads(self.data[HEADER.size : HEADER.size + size])


def _stream(fd: int, spec, write: bool):
    """A text stream on `fd` as the client's interpreter set up its own (encoding, errors, buffering)."""
    enc, errors, line_buffering, write_through = spec or ("utf-8", "strict", False, False)
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    buf = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    return io.TextIOWrapper(
        buf, encoding=enc, errors=errors, line_buffering=line_buffering, write_through=write_through
    )


def _fresh_ours() -> None:
    """Forget our modules (and the server's TE-stub finder: the fresh stack installs a fresh one), so the plan
    imports today's recipes/, src/ and launch/."""
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__.split(".")[0] not in OURS]
    for name in [n for n in sys.modules if n.split(".")[0] in OURS]:
        del sys.modules[name]
    importlib.invalidate_caches()  # directory listings cached by the path finders: a new recipe file is found
    linecache.clearcache()


def worker(request: dict, fds: list[int]) -> int:
    """In the forked worker: become the client (fds, environment, cwd, sys.path, argv), plan, return the status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    specs = request.get("streams") or [None] * 3
    sys.stdin = sys.__stdin__ = _stream(0, specs[0], write=False)
    sys.stdout = sys.__stdout__ = _stream(1, specs[1], write=True)
    sys.stderr = sys.__stderr__ = _stream(2, specs[2], write=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()  # sys.path stays the server's: the stamp says it started as the client's, plus the import's own
    sys.argv = [request["argv0"], *request["argv"]]
    _fresh_ours()
    try:
        code = importlib.import_module(request["module"]).cli(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # as the plain path: Python's own report of an unexpected error
        sys.excepthook(*sys.exc_info())
        code = 1
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            s.flush()
    return code if isinstance(code, int) else 1


def serve(environ: dict | None = None, path: list | None = None) -> int:
    """The server's main: lock, stamp, preload, listen, loop. Exits 0 when another server already holds the lock.
    `environ`/`path`: what the process started with, when it becomes the server after a command of its own."""
    paths = Paths.of().private()
    lock = _take_lock(paths)
    if lock is None:
        log("another plan server holds this checkout's lock: exiting")
        return 0
    _set_state(lock, "starting")
    env0, path0 = dict(environ or os.environ), list(path or sys.path)
    stamp0 = stamp(env0, path0)
    log(f"starting for {ROOT}")
    try:
        if environ is None:
            preload(lock)
        else:  # it has just run a command: what planning imports is loaded; a worker imports anything else itself
            log(f"serving from the process that imported Megatron Bridge for its own command (pid {os.getpid()})")
    except Exception as exc:  # recorded, so clients plan in their own process instead of restarting this in a loop
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        paths.failed.write_text(json.dumps({"stamp": stamp0, "why": why}))  # until the stamp changes
        log(f"preload failed: {why}")
        return 1
    with contextlib.suppress(FileNotFoundError):
        paths.failed.unlink()
    server = Server(paths, lock, env0, path0, stamp0, loaded_files())
    server.wake = os.pipe()
    os.set_blocking(server.wake[1], False)
    signal.set_wakeup_fd(server.wake[1], warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the pipe the moment a worker ends
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "terminated", True))  # acted on in the loop
    try:
        server.bind()
    except OSError as exc:  # the socket path holds something else (clients say so in a note), or no room to bind
        log(f"not serving: {exc}")
        return 1
    gc.freeze()  # the preloaded objects are never collected: workers do not touch (copy) their pages in a GC pass
    _set_state(lock, "ready")
    log(f"ready: {len(server.files)} module files watched, {paths.sock}")
    try:
        return server.loop()
    finally:
        server.close_listener()
        log(f"exited ({server.stale or 'stopped'})")
