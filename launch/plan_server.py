"""The plan server: `make plan`, `recipes`, `new-recipe`, `submit`, `sbatch` and `nightly` in about a second once
torch and Megatron Bridge are loaded.

Why: `import megatron.bridge` (torch, Megatron Core, every model bridge, modelopt, ...) costs about 50 s here, and
a command after it about 1 s. One process pays the import; each later command forks from it.

When: a command that finds no server runs in its own process, as before, paying the import; once it has printed
its result it forks, and the child (own session, output to the log beside the socket) becomes the server, saying
so in one `note:` line (its pid, the idle limit, how to stop it). So a second command typed right after a cold
first one is served, with no second import. A command that finds a server still starting waits for it.

What is loaded in the server, one per user and checkout: torch and Bridge, and whatever the command that became it
imported (a server started by `python -m launch.plan_server --serve`, as `make bench` and the tests do, imports
Bridge and then, by name, the third-party modules a throwaway child loads planning every recipe). Our own modules
(overlapkit.*, recipes.*, launch.*) are never used by a worker: each drops them from sys.modules first.

What is imported fresh for every command: a request (`python -m launch.<cmd> ...` finds the server on a Unix
socket) names the module, from SERVED; a forked worker drops our modules, takes the client's argv, environment,
working directory and stdin/stdout/stderr (the file descriptors themselves, passed over the socket with
SCM_RIGHTS, so rich sees the client's terminal, width and colours exactly as the plain path does; the stamp below
guarantees the same sys.path), runs the module's `cli()` (what its `python -m` entry runs) and reports its exit
status, which the client exits with. Re-importing our code costs about 0.2 s, and it is why an edit to recipes/,
src/ or launch/ shows in the very next command. Bad input, and actions that need no Bridge (status, cancel, ...),
are answered by the client itself (each module's `precheck`), before any server is asked or started.

Restart rules (no command ever runs on a stale stack):
- the server records a stamp at start (`stamp()`: the interpreter, sys.path, uv.lock's hash, the venv's
  pyvenv.cfg and site-packages directories, the content of the files of ours it runs, and the environment
  variables that packages read at import time: HF_*, TORCH*, CUDA*, PYTHON*, LC_*, ...), and the mtime and size
  of every third-party module file it loaded;
- a request whose client computes another stamp, or that finds any of those files changed, is refused: the server
  stops listening, finishes the commands in flight and exits, and the client runs its command itself (so it costs
  what it costs without a server) and then becomes the next server;
- it exits after 15 idle minutes (OVERLAPKIT_PLAN_SERVER_IDLE seconds) and checks its stamp every minute meanwhile.

Never: two checkouts (the socket is named after the checkout's absolute path, and a request naming another
checkout is refused), another user (a 0700 directory, and the peer's uid is checked), a command on a stale stack,
a submission run twice (a worker lost mid-submit is reported, not retried), a traceback where the server cannot
help (one `note:` line, and the command runs in the client's own process), a server inside a Slurm job, or one at
all when OVERLAPKIT_PLAN_SERVER=0 (the test suite sets it, and runs one session server in a private directory
for the tests that ask for it). `make plan-server-stop` stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import importlib
import io
import json
import linecache
import os
import select
import signal
import site
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio, stack
from overlapkit.plan.env import is_secret

ROOT = stack.REPO_ROOT
SWITCH = "OVERLAPKIT_PLAN_SERVER"  # 0/off/false/no: plan in this process, start nothing
DIR_VAR = "OVERLAPKIT_PLAN_SERVER_DIR"  # socket directory (default $XDG_RUNTIME_DIR/overlapkit, /tmp/overlapkit-<uid>)
IDLE_VAR = "OVERLAPKIT_PLAN_SERVER_IDLE"  # seconds without a request before it exits
SALT_VAR = "OVERLAPKIT_PLAN_SERVER_STAMP"  # test hook: mixed into the stamp, as a changed venv would be
IDLE_S = 15 * 60
OURS = ("overlapkit", "recipes", "launch")  # top-level packages whose modules every plan imports fresh
# The commands served, by module: each pays the Bridge import on its plain path. The worker calls the module's
# `cli(argv)`, exactly what its `python -m` entry calls; a request naming any other module is refused.
SERVED = ("launch.plan", "launch.new_recipe", "launch.submit", "launch.nightly")
# Imported by the probe after its plans: the submission stack (nemo_run, Bridge's run plugins) that served submit,
# sbatch and nightly commands would otherwise import in every worker.
SUBMITTING = ("nemo_run", "megatron.bridge.recipes.run_plugins", "launch.submit", "launch.nightly")
# The files of ours that run in the server itself (before and around the import): an edit restarts it.
SERVER_SOURCES = [
    *(ROOT / "src/overlapkit" / f for f in ("__init__.py", "stack.py", "te_stub.py")),
    ROOT / "launch/__init__.py",
    Path(__file__).resolve(),
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
    server answers, or {"lost": why} when it stopped after accepting a plan."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    accepted = None
    try:
        sock.settimeout(30)  # the server answers a request within milliseconds; a plan may then take long
        sock.connect(str(paths.sock))
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
    a stale one, or none possible). Starts one in the background when none answers, so the next command is fast."""
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
    watch_make()
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
    if "lost" in reply:
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
    if may_serve(paths):
        SUCCESSOR.append(paths)  # this process pays the import: once its command is done it serves the next
    return None


def wait_starting(paths: Paths, timeout: float = 300) -> bool:
    """A server that holds the lock but does not answer yet is starting (importing, or binding after the command
    that became it): waiting for it costs less than this process's own import. True once it answers."""
    held = holder(paths)
    if held is None or held[1] != "starting":
        return False
    return wait_ready(paths, timeout) is not None


def watch_make() -> None:
    """A client is make's child: when make dies (even by kill -9) the client ends too (the default SIGTERM), the
    server sees its connection close and stops the worker, whose handlers mark a submission failed."""
    from overlapkit.cluster import submit

    submit.watch_make()


def run(module: str, argv, precheck, cli) -> int:
    """A command line served where it can be: `precheck(argv)` is everything checked before the Bridge import (True:
    the request is good and needs Bridge); bad input and commands that need no Bridge are answered by `cli` here."""
    argv = list(argv)
    if not precheck(argv):
        return cli(argv)
    code = forward(argv, module)
    if code is not None:
        return code
    code = cli(argv)
    if SUCCESSOR:
        become_server(SUCCESSOR[0])
    return code


def quietly(check) -> bool:
    """True when `check()` passes; False on bad input (the plain path then says it, once, in one line)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            check()
    except (SystemExit, KeyError, ValueError, OSError, RuntimeError):
        return False
    return True


SUCCESSOR: list[Paths] = []  # set by forward(): this process becomes the server after its command (run())


def may_serve(paths: Paths) -> bool:
    """Should this process, once its command is done, become the server? Not when one holds the lock (starting or
    serving: this command only missed it), nor when the last start failed for this same stack (one line)."""
    held = holder(paths)
    if held and held[1] != "stopping":
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
    from overlapkit.cluster import submit

    submit.stop_watching()  # make's watcher: the command is done, and the server outlives make
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
        code = serve(environ=ENV_AT_START, path=PATH_AT_START)
    finally:
        os._exit(code)


def start(paths: Paths) -> bool:
    """Start this checkout's server as a process of its own, detached (own session, output to its log); `make bench`
    and the tests do, where no command is to pay for the import. One line when it cannot."""
    held = holder(paths)
    if held and held[1] != "stopping":
        return True  # one is starting (importing): a second would only wait for its lock and leave
    try:
        cmd = [sys.executable, "-m", "launch.plan_server", "--serve"]
        with open(paths.log, "a") as log:  # appended: a stale server may still be writing its last lines
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as exc:
        note(f"could not start the plan server ({exc})")
        return False
    return True


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
            with contextlib.suppress(OSError):
                if os.stat(self.paths.sock).st_ino == self.sock_ino:
                    os.unlink(self.paths.sock)
            self.listener.close()
            self.listener = None

    def bind(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.paths.sock)  # a dead server's socket: we hold the lock, so no live one owns it
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.paths.sock))
        os.chmod(self.paths.sock, 0o600)
        self.sock_ino = os.stat(self.paths.sock).st_ino
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
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
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
    server.bind()
    gc.freeze()  # the preloaded objects are never collected: workers do not touch (copy) their pages in a GC pass
    _set_state(lock, "ready")
    log(f"ready: {len(server.files)} module files watched, {paths.sock}")
    try:
        return server.loop()
    finally:
        server.close_listener()
        log(f"exited ({server.stale or 'stopped'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.plan_server", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--serve", action="store_true", help="run the server (the first make plan starts it)")
    g.add_argument("--stop", action="store_true", help="stop this checkout's server (make plan-server-stop)")
    g.add_argument("--status", action="store_true", help="say whether this checkout's server runs")
    args = ap.parse_args(argv)
    try:
        paths = Paths.of().private()
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.serve:
        code = serve()
        os._exit(code)  # no interpreter teardown: nothing to flush, and extensions report "leaks" of frozen objects
    if args.stop:
        print(stop(paths))
        return 0
    held = holder(paths)
    print(f"plan server pid {held[0]}: {held[1]} ({paths.sock})" if held else "no plan server running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
