"""The plan server (src/overlapkit/serve/) as `make` uses it, in new processes: every shipped recipe plans the same
through it as on the plain path (JSON, and the text on a terminal), and so do served sbatch, submit DRYRUN, nightly
DRYRUN and new-recipe; an edited recipe shows in the next plan, a changed stack stamp makes the client restart it,
another checkout's request is refused, bad input never reaches it, and `make plan-server-stop` stops it.

The server is the session's (tests/conftest.py: one Bridge import for every e2e `make`). The plain path's side is
this pytest process, which imported Bridge itself as a plain `make plan` does: its JSON in-process, its terminal text
in a child forked onto a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pty
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

from overlapkit import stack
from overlapkit.plan import registry
from overlapkit.serve import client as serve_client
from overlapkit.serve import paths as serve_paths
from overlapkit.serve import server as serve_server

ROOT = stack.REPO_ROOT


def _shipped() -> list[str]:
    """The recipes of the committed files in recipes/ (a fork another test or a user is writing there is not one)."""
    try:
        tracked = subprocess.run(["git", "ls-files", "recipes"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file in recipes/
        return [n for n in registry.names() if registry.shipped(n)]
    files = set(tracked.stdout.split())
    module_file = lambda n: Path(sys.modules[registry.get(n).build.__module__].__file__)  # noqa: E731
    return [n for n in registry.names() if registry.shipped(n) and f"recipes/{module_file(n).name}" in files]


SHIPPED = _shipped()
TEXT_RECIPE = "llama3_70b_pretrain_64gpu_h100_bf16"
COLS = 100  # not the 120 a pipe gets: the terminal's own width must reach rich through the passed descriptors
EDITED = """
from megatron.bridge.recipes.llama import llama3_8b_pretrain_config as base

from recipes._base import Layout, h100_pretrain, register


@register(model="Llama3 8B", nodes=1, source="tests/e2e/test_plan_server_e2e.py")
def llama3_8b_pretrain_8gpu_h100_bf16_okps():
    return h100_pretrain(base, "bf16", Layout(tp=1, pp=1, cp=2, vpp=None, mbs=1, gbs={gbs}, seq=8192))
"""


class Terminal:
    """A process whose stdin/stdout/stderr are a terminal COLS wide; its output is read as it comes."""

    def __init__(self, cmd: list[str], env: dict):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLS, 0, 0))
        env = {**env, "TERM": "xterm-256color"}
        env.pop("COLUMNS", None)
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env, start_new_session=True
        )
        os.close(slave)
        self.master, self.out = master, bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not chunk:
                return
            self.out += chunk

    def wait(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        os.close(self.master)
        return rc, self.out.decode()


class Server:
    """The session's server: the environment its clients run with, a client call, a restart as a first plan would."""

    def __init__(self, env: dict):
        self.env = env
        self.paths = serve_paths.Paths.of(environ=self.env)

    def spawn(self) -> None:
        """Start it as a first `make plan` does (same command, own session), without the plain plan beside it."""
        cmd = [sys.executable, "-m", "launch.plan_server", "--serve"]
        with open(self.paths.log, "a") as log:
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self) -> dict:
        if serve_paths.holder(self.paths) is None:
            self.spawn()
        reply = serve_client.wait_ready(self.paths, timeout=600)
        assert reply is not None, self.paths.log.read_text()
        return reply

    def run(self, module: str, *args: str, env: dict | None = None, timeout: float = 120):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def plan(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run("launch.plan", *args, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def server(served_alone):
    return Server(served_alone)


def plain_text_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """`launch.plan.main(argv)` in a child of this process (Bridge imported by itself, as on the plain path) whose
    standard streams are a terminal COLS wide, as a user's shell gives them."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLS, 0, 0))
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setsid()
            os.close(master)
            for fd in (0, 1, 2):
                os.dup2(slave, fd)
            os.environ.update({"TERM": "xterm-256color", serve_paths.SWITCH: "0"})
            for name in ("COLUMNS", "NO_COLOR"):
                os.environ.pop(name, None)
            sys.stdin, sys.stdout, sys.stderr = (open(fd, mode, closefd=False) for fd, mode in enumerate("rww"))
            code = importlib.import_module("launch.plan").main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child has closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), out.decode()


def normalised(stdout: str) -> dict:
    """The JSON plan with its run directory reduced to the recipe's name (the time stamp and parent differ)."""
    plan = json.loads(stdout)
    plan["run_dir"] = re.sub(r"-\d{8}-\d{6}(\.\d+)?$", "", Path(plan["run_dir"]).name)
    return plan


def findings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error:", "warning:"))]


def test_every_shipped_recipe_plans_the_same_through_the_server_as_on_the_plain_path(server, capsys):
    before = server.ready()
    runs = tempfile.mkdtemp(prefix="okps-b-", dir="/tmp")  # both sides' run directories: same length, same wrapping
    try:
        fast = {name: server.plan(name, "--format", "json", "--runs", runs) for name in SHIPPED}
        cmd = [sys.executable, "-m", "launch.plan", TEXT_RECIPE, "--runs", runs]
        text_rc, text = Terminal(cmd, server.env).wait(120)
        plain = {}
        for name in SHIPPED:
            rc = importlib.import_module("launch.plan").main([name, "--format", "json", "--runs", runs])
            plain[name] = (rc, *capsys.readouterr())
        plain_rc, plain_text = plain_text_on_a_terminal([TEXT_RECIPE, "--runs", runs])
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    after = server.ready()
    assert after["pong"] == before["pong"] and after["served"] == before["served"] + len(SHIPPED) + 1  # all served
    assert len(SHIPPED) >= 10
    for name in SHIPPED:
        rc, out, err = plain[name]
        got = fast[name]
        assert (got.returncode, findings(got.stderr)) == (rc, findings(err)), name
        assert normalised(got.stdout) == normalised(out), name
    run_line = re.compile(r"run directory: \S+")
    assert text_rc == plain_rc == 0
    assert run_line.sub("run directory: <dir>", text) == run_line.sub("run directory: <dir>", plain_text)
    assert "\x1b[" in text and max(len(re.sub(r"\x1b\[[0-9;]*m", "", line)) for line in text.splitlines()) <= COLS


def test_an_edited_recipe_shows_in_the_next_fast_plan(server, tmp_path):
    before = server.ready()
    mine = tmp_path / "my_recipes"
    mine.mkdir()
    recipe = mine / "okps_edited.py"
    name = "llama3_8b_pretrain_8gpu_h100_bf16_okps"
    gbs = []
    for value in (128, 1024):  # another length too: a .pyc is trusted when the size and the second agree
        recipe.write_text(EDITED.format(gbs=value))
        out = server.plan(name, "--format", "json", "--runs", str(tmp_path / "runs"), env={"RECIPES_PATH": str(mine)})
        assert out.returncode == 0, out.stderr
        gbs.append(json.loads(out.stdout)["layout"]["gbs"])
    assert gbs == [128, 1024]
    after = server.ready()
    assert after["pong"] == before["pong"] and after["served"] == before["served"] + 2  # both served, no restart


def test_a_server_of_another_checkout_is_never_used(server, tmp_path):
    other = tmp_path / "other-checkout"
    assert serve_paths.Paths.of(other, environ=server.env).sock != server.paths.sock
    before = server.ready()
    request = serve_client._request(["llama3_8b_pretrain_8gpu_h100_bf16"], root=other)
    fds = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    try:
        reply = serve_client.ask(server.paths, request, fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert reply == {"refused": f"this server plans {ROOT}, not {other}"}
    after = server.ready()
    assert after == before  # still up, and nothing was planned


def test_a_silent_or_half_sent_client_stalls_no_other(server):
    before = server.ready()
    silent, half = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    try:
        silent.connect(str(server.paths.sock))
        half.connect(str(server.paths.sock))
        half.sendall(serve_paths.HEADER.pack(1000) + b'{"op": "pi')  # promises 1000 bytes, sends 10
        t0 = time.monotonic()
        reply = serve_client.ask(server.paths, {"op": "ping"})
        assert "pong" in reply and time.monotonic() - t0 < serve_server.READ_S / 2  # not after their 10 s
    finally:
        silent.close()
        half.close()
    assert server.ready()["pong"] == before["pong"]


def test_a_process_with_a_second_thread_does_not_become_the_server(tmp_path):
    code = (
        "import threading, time; from overlapkit.serve import client, paths\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "client.become_server(paths.Paths.of().private())\n"
    )
    env = {**os.environ, serve_paths.DIR_VAR: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.startswith("note: not serving: this process runs 2 threads"), out
    assert serve_paths.holder(serve_paths.Paths.of(environ=env)) is None  # nothing forked, nothing listening


def test_bad_input_is_answered_without_a_server(tmp_path):
    sockets = tempfile.mkdtemp(prefix="okps-", dir="/tmp")
    try:
        env = {**os.environ, serve_paths.DIR_VAR: sockets}
        env.pop(serve_paths.SWITCH, None)
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "launch.plan", "llama3_8b_pretrain_8gpu_h100_bf16", "--nodes", "0"]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and out.stderr.startswith("error: NODES='0'") and len(out.stderr.splitlines()) == 1
        assert time.monotonic() - t0 < 10 and os.listdir(sockets) == []  # no server asked, none started
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_the_stamp_reads_the_real_lock_file(tmp_path):
    (tmp_path / "uv.lock").write_text("version = 1\n")
    a = serve_paths.stamp(os.environ, root=tmp_path)
    (tmp_path / "uv.lock").write_text("version = 2\n")
    b = serve_paths.stamp(os.environ, root=tmp_path)
    assert serve_paths.differences(a, b) == "uv.lock"
    assert serve_paths.differences(a, serve_paths.stamp({**os.environ, "HF_HOME": "/elsewhere"}, root=tmp_path)) in (
        "$HF_HOME, uv.lock",
        "uv.lock, $HF_HOME",
    )


def masked(text: str, *dirs: Path) -> str:
    """Text with the given directories and run-directory time stamps replaced (the two sides write to their own)."""
    for d in dirs:
        text = text.replace(str(d), "<dir>")
    text = re.sub(r"_\d{19}\b", "_<id>", text)  # nemo_run's experiment id: the time in nanoseconds
    return re.sub(r"-\d{8}-\d{6}(\.\d+)?", "-<time>", text)


R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
# Each served command with the plain path's call of the same function in this process (module, argv, its job dir).
SERVED_COMMANDS = {
    "sbatch": ("launch.submit", ["sbatch", "--recipe", R8, "--cluster", "{profile}", "--preflight", "1"]),
    "submit DRYRUN=1": ("launch.submit", ["submit", "--recipe", R8, "--cluster", "{profile}", "--dryrun", "1"]),
    "nightly DRYRUN=1": (
        "launch.nightly",
        ["submit", "--cluster", "local", "--dryrun", "1", "--job-dir", "{jobs}", "--max-nodes", "8"],
    ),
    "new-recipe": (
        "launch.new_recipe",
        [
            "--from",
            "llama3_70b_pretrain_64gpu_h100_bf16",
            "--name",
            "llama3_34b_pretrain_32gpu_h100_bf16",
            "--layers",
            "48",
            "--ffn",
            "22016",
            "--recipes-dir",
            "{jobs}",
        ],
    ),
}


def _side(tmp: Path, name: str) -> tuple[Path, Path]:
    """A side's own job directory, and a profile of the same name on both sides that writes there."""
    (tmp / name).mkdir()
    jobs, profile = tmp / name / "jobs", tmp / name / "site.toml"
    local = (ROOT / "slurm/profiles/local.toml").read_text()
    profile.write_text(re.sub(r"(?m)^job_dir\s*=.*$", f'job_dir = "{jobs}"', local))
    jobs.mkdir()
    return jobs, profile


@pytest.mark.parametrize("what", sorted(SERVED_COMMANDS))
def test_served_commands_print_and_write_what_the_plain_path_does(server, what, tmp_path, capsys, monkeypatch):
    module, template = SERVED_COMMANDS[what]
    outputs, written = [], []
    for side in ("plain", "serve"):  # names of one length: a path in a table wraps the same on both sides
        jobs, profile = _side(tmp_path, side)
        argv = [a.format(jobs=jobs, profile=profile) for a in template]
        if side == "plain":  # the function the worker runs, here: its signal handlers put back after it
            monkeypatch.delenv("OVERLAPKIT_MAKE_PID", raising=False)  # no watcher of make in pytest
            # cli's own default, set here so that it leaves with the test (a stamped variable: left in this
            # process's environment it would make every later client restart the session's server)
            monkeypatch.setenv("NEMORUN_HOME", str(ROOT / "runs" / "nemo_run"))
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            try:
                rc = importlib.import_module(module).cli(argv)
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
                registry.unregister("llama3_34b_pretrain_32gpu_h100_bf16")  # a fork registers in this process too
            out, err = capsys.readouterr()
        else:
            before = server.ready()["served"]
            got = server.run(module, *argv)
            rc, out, err = got.returncode, got.stdout, got.stderr
            assert server.ready()["served"] == before + 1  # served, not planned by the client itself
        outputs.append((rc, masked(out, jobs.parent), findings(err)))  # its parent: a table may cut a path short
        # submission.json is left out: it records when and by which pid it was submitted
        files = sorted(f for f in jobs.rglob("*") if f.suffix in (".sh", ".py", ".json", ".yaml"))
        files = [f for f in files if f.is_file() and f.name != "submission.json"]
        written.append({masked(str(f.relative_to(jobs))): masked(f.read_text(), jobs.parent) for f in files})
    assert outputs[0][0] == 0 and outputs[0] == outputs[1]
    assert written[0] == written[1] and (what.startswith(("nightly", "submit")) or written[0])


def test_the_cold_plan_becomes_the_server_and_the_plan_typed_at_once_after_it_is_served(first_plans, server):
    (first, _), (second, took) = first_plans  # the session's first two plans (tests/conftest.py)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert normalised(first.stdout) == normalised(second.stdout)
    (note,) = first.stderr.splitlines()  # one line: who serves now, until when, how to stop it
    pid = int(re.match(r"note: pid (\d+) keeps Megatron Bridge loaded and serves", note).group(1))
    assert "make plan-server-stop stops it" in note and second.stderr == ""  # served: no note, no import
    assert serve_paths.holder(server.paths)[0] == pid
    log = server.paths.log.read_text()
    assert f"[{pid}] serving from the process that imported Megatron Bridge for its own command" in log
    assert "imported Megatron Bridge in" not in log  # no second import in this session: the first plan's serves
    assert took < 30  # far below an import (docs/architecture.md, measured facts)


@pytest.mark.stops_server
def test_a_changed_stamp_makes_the_client_plan_itself_and_become_the_next_server(server, tmp_path):
    old = server.ready()["pong"]
    cmd = [sys.executable, "-m", "launch.plan", "llama3_8b_pretrain_8gpu_h100_bf16", "--runs", str(tmp_path)]
    env = {**server.env, serve_paths.SALT_VAR: "another venv"}
    client = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900
    )
    assert client.returncode == 0, client.stderr
    assert not _alive(old)  # the stale server is gone: it refused the plan and exited
    new = serve_paths.holder(server.paths)
    assert new is not None and new[0] != old, server.paths.log.read_text()
    log = server.paths.log.read_text()
    assert f"[{old}] stopping: the client differs in ${serve_paths.SALT_VAR}" in log
    # the restart says only that the client now serves: its own plan paid the import (one note, no other line)
    (line,) = client.stderr.splitlines()
    assert line.startswith(f"note: pid {new[0]} keeps Megatron Bridge loaded and serves this checkout's next")


@pytest.mark.stops_server
def test_make_plan_server_stop_stops_it(server):
    if serve_paths.holder(server.paths) is None:
        server.spawn()
        time.sleep(1)
    held = serve_paths.holder(server.paths)
    assert held is not None
    stop = ["make", "-s", "plan-server-stop"]
    first = subprocess.run(stop, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stdout.startswith(f"stopped the plan server (pid {held[0]}, was "), first
    assert serve_paths.holder(server.paths) is None and not _alive(held[0])
    again = subprocess.run(stop, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120)
    assert again.stdout == "no plan server was running for this checkout\n"


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie awaiting its parent, this pytest, has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
