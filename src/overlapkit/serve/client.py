"""The plan server's client side: every command line served where it can be, and the process that paid for the
import becoming the server (overlapkit/serve/__init__.py says how it all works)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from overlapkit import jsonio, makewatch
from overlapkit.serve.paths import (
    ENV_AT_START,
    HEADER,
    IDLE_S,
    IDLE_VAR,
    PATH_AT_START,
    ROOT,
    SWITCH,
    Paths,
    _file_id,
    holder,
    peer_problem,
    socket_problem,
    stamp,
)

# --- the client --------------------------------------------------------------------------------------------------


def disabled(environ=None) -> bool:
    """Off by the switch, and always inside a Slurm job (a nightly's scheduler job runs `make nightly` on a compute
    node: a daemon left there would outlive nothing useful, and the job's own import is what it measures)."""
    env = os.environ if environ is None else environ
    return env.get(SWITCH, "1").strip().lower() in ("0", "off", "false", "no") or "SLURM_JOB_ID" in env


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def _std_fds() -> tuple[list[int], list[int]]:
    """The client's fds 0, 1, 2 to pass (a closed one is replaced by /dev/null), and those opened here to close."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
    return fds, opened


def _stream_spec(stream) -> tuple | None:
    """How this interpreter set up a standard stream, for the worker to do the same (None: its defaults)."""
    try:
        return (stream.encoding, stream.errors, stream.line_buffering, stream.write_through)
    except AttributeError:  # closed, or replaced by something that is not a text stream
        return None


def _request(argv, root: Path = ROOT, module: str = "launch.plan") -> dict:
    streams = [_stream_spec(s) for s in (sys.stdin, sys.stdout, sys.stderr)]
    return {
        "op": "run",
        "module": module,
        "root": str(root),
        "stamp": stamp(os.environ, root=root),
        "argv": list(argv),
        "argv0": sys.argv[0],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "streams": streams,
    }


def _lines(sock: socket.socket):
    """Reply lines (JSON) from the server until it closes the connection."""
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def ask(paths: Paths, request: dict, fds=()) -> dict:
    """Send one request; returns the final reply ({"rc"}, {"pong"}, {"stale"}, {"refused"}), {"none": why} when no
    server answers, {"unsafe": why} when what is at the socket path is not this checkout's server (nothing sent), or
    {"lost": why} when it stopped after accepting a plan."""
    if problem := socket_problem(paths):
        return {"unsafe": problem}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    accepted = None
    try:
        sock.settimeout(30)  # the server answers a request within milliseconds; a plan may then take long
        sock.connect(str(paths.sock))
        if problem := peer_problem(paths, sock):
            return {"unsafe": f"{problem}: nothing sent"}
        body = json.dumps(request).encode()
        data = HEADER.pack(len(body)) + body
        sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
        if sent < len(data):  # never an empty send: on a connection the server has answered and closed, EPIPE
            sock.sendall(data[sent:])
        for reply in _lines(sock):
            if "accepted" in reply:
                accepted = reply["accepted"]
                sock.settimeout(None)
            else:
                return reply
        why = "the connection closed"
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    finally:
        sock.close()
    return {"lost": f"worker {accepted}: {why}"} if accepted else {"none": why}


# Commands whose work is safe to do again in the client when the server was lost mid-way (a plan writes a new run
# directory); a submission or a fork is not: it may have happened, and its run directory says so.
REPEATABLE = ("launch.plan",)


def forward(argv, module: str = "launch.plan") -> int | None:
    """Run `module`'s command in the server: its exit status, or None when this process must run it (no server yet,
    a stale one, or none possible; run() then lets this process become the server once its command is done)."""
    if disabled():
        return None
    try:
        paths = Paths.of().private()
    except (OSError, ValueError) as exc:
        note(f"plan server off ({exc}); running in this process")
        return None
    try:
        request = _request(argv, module=module)
    except OSError as exc:  # the working directory is gone, say: the command here says what it makes of that
        note(f"plan server not asked ({exc}); running in this process")
        return None
    fds, opened = _std_fds()
    # make's child: when make dies (even by kill -9) this client ends too (the default SIGTERM), the server sees the
    # connection close and stops the worker, whose handlers mark a submission failed
    makewatch.watch_make()
    try:
        reply = ask(paths, request, fds)
        if "none" in reply and wait_starting(paths):
            reply = ask(paths, request, fds)
    except KeyboardInterrupt:
        return 130  # the server sees the closed connection and stops the worker
    finally:
        for fd in opened:
            os.close(fd)
    if "rc" in reply:
        return reply["rc"]
    if "unsafe" in reply:  # the fast path is not taken: said once, here (may_serve does not say it again)
        note(f"plan server not used: {reply['unsafe']}; running in this process")
    elif "lost" in reply:
        if module not in REPEATABLE:
            note(
                f"the plan server stopped during this command ({reply['lost']}; log: {paths.log}); not run again "
                "here: see what it left (make status) and run it again"
            )
            return 1
        note(f"the plan server stopped during this plan ({reply['lost']}; log: {paths.log}); planning here")
    elif "refused" in reply:
        note(f"the plan server refused this command ({reply['refused']}); running in this process")
    return None


def wait_starting(paths: Paths, timeout: float = 300) -> bool:
    """A server that holds the lock but does not answer yet is starting (importing, or binding after the command
    that became it): waiting for it costs less than this process's own import. True once it answers."""
    held = holder(paths)
    if held is None or held[1] != "starting":
        return False
    return wait_ready(paths, timeout) is not None


def run(module: str, argv, precheck, cli) -> int:
    """A command line served where it can be: `precheck(argv)` is everything checked before the Bridge import (True:
    the request is good and needs Bridge); bad input and commands that need no Bridge are answered by `cli` here."""
    argv = list(argv)
    if not precheck(argv):
        return cli(argv)
    code = forward(argv, module)
    if code is not None:
        return code
    code = cli(argv)  # this process paid the import: once its command is done it may serve the next ones
    if (paths := successor_paths()) is not None:
        become_server(paths)
    return code


def successor_paths() -> Paths | None:
    """Where this process should serve from after its own command: None when no server is wanted here (switched off,
    in a Slurm job, no private directory) or one already holds the lock (may_serve)."""
    if disabled():
        return None
    try:
        paths = Paths.of().private()
    except (OSError, ValueError):  # forward() said why, in one line
        return None
    return paths if may_serve(paths) else None


def quietly(check) -> bool:
    """True when `check()` passes; False on bad input (the plain path then says it, once, in one line)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            check()
    except (SystemExit, KeyError, ValueError, OSError, RuntimeError):
        return False
    return True


def may_serve(paths: Paths) -> bool:
    """Should this process, once its command is done, become the server? Not when one holds the lock (starting or
    serving: this command only missed it), nor when the last start failed for this same stack (one line)."""
    held = holder(paths)
    if (held and held[1] != "stopping") or socket_problem(paths):  # forward() said what is at the socket path
        return False
    failed = jsonio.read_json(paths.failed)
    if failed and failed.get("stamp") == stamp(ENV_AT_START, PATH_AT_START):
        note(
            f"the plan server failed to start ({failed.get('why')}; log: {paths.log}); running in this process "
            "(make plan-server-stop clears this)"
        )
        return False
    return True


def become_server(paths: Paths) -> None:
    """The process that paid for the import serves the next commands: it forks, the parent returns (its command's
    output is complete: make sees it end), and the child leaves the terminal and serves, Bridge already loaded."""
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            s.flush()  # nothing buffered may be written twice, by parent and child
    makewatch.stop_watching()  # make's watcher: the command is done, and the server outlives make
    if (threads := threading.active_count()) > 1:
        note(
            f"not serving: this process runs {threads} threads, and a fork copies only one (and any lock another held)"
        )
        return
    try:
        if _file_id(paths.log) and _file_id(paths.log)[1] > 1 << 20:  # keep one older log, never a growing one
            os.replace(paths.log, paths.log.with_suffix(".log.1"))
        out = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        pid = os.fork()
    except OSError as exc:
        note(f"could not start the plan server ({exc}); the next command imports Bridge again")
        return
    if pid:
        os.close(out)
        idle = os.environ.get(IDLE_VAR) or IDLE_S
        note(
            f"pid {pid} keeps Megatron Bridge loaded and serves this checkout's next commands (until {idle} s idle; "
            f"make plan-server-stop stops it, {SWITCH}=0 starts none)"
        )
        return
    code = 1
    try:
        os.setsid()  # no terminal: make's Ctrl-C and the shell's hang-up are the client's, never the server's
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out, 1), (out, 2)):
            os.dup2(fd, target)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # a command's own handlers (submit's) do not carry over
        from overlapkit.serve import server  # here: the client's commands never load the server's code

        code = server.serve(environ=ENV_AT_START, path=PATH_AT_START)
    finally:
        os._exit(code)


def stop(paths: Paths, timeout: float = 10.0) -> str:
    """Stop this checkout's server (also while it is still importing); one line saying what happened."""
    with contextlib.suppress(OSError):
        paths.failed.unlink()
    held = holder(paths)
    if held is None:
        return "no plan server was running for this checkout"
    pid, state = held
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while holder(paths) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    if holder(paths) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"plan server (pid {pid}) did not stop in {timeout:.0f} s: killed"
    return f"stopped the plan server (pid {pid}, was {state})"


def wait_ready(paths: Paths, timeout: float) -> dict | None:
    """Poll until the server answers a ping ({"pong": pid, "served": plans so far}), or None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = ask(paths, {"op": "ping"})
        if "pong" in reply:
            return reply
        time.sleep(0.5)
    return None
