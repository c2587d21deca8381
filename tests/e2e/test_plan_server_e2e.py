"""The plan server (launch/plan_server.py) as `make plan` uses it, in new processes: every shipped recipe plans the
same through it as in a fresh full-import process (JSON, and the text on a terminal), an edited recipe shows in the
next plan, a changed stack stamp makes the client restart it, another checkout's request is refused, bad input
never reaches it, and `make plan-server-stop` stops it.

One server (one ~50 s Bridge import) serves the module; it lives in a private socket directory, so a server you are
using for this checkout is never touched, and it is stopped at the end. The fresh process imports alongside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

from launch import plan_server
from overlapkit import stack
from overlapkit.plan import registry

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
FRESH = """
import contextlib, io, json, sys
from launch import plan
out, runs, text_recipe, *names = sys.argv[1:]
for name in names:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = plan.main([name, "--format", "json", "--runs", runs])
    with open(f"{out}/{name}.json", "w") as f:
        json.dump({"rc": rc, "stdout": o.getvalue(), "stderr": e.getvalue()}, f)
sys.exit(plan.main([text_recipe, "--runs", runs]))
"""
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
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env,
                                     start_new_session=True)  # fmt: skip
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
    """This module's server: its private directory, the environment its clients run with, a client call."""

    def __init__(self, sockets: str):
        self.env = {**os.environ, plan_server.DIR_VAR: sockets}
        self.env.pop(plan_server.SWITCH, None)  # the suite turns the server off; these clients use it
        self.paths = plan_server.Paths.of(environ=self.env)

    def spawn(self) -> None:
        """Start it as a first `make plan` does (same command, own session), without the plain plan beside it."""
        cmd = [sys.executable, "-m", "launch.plan_server", "--serve"]
        with open(self.paths.log, "a") as log:
            subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def ready(self) -> dict:
        if plan_server.holder(self.paths) is None:
            self.spawn()
        reply = plan_server.wait_ready(self.paths, timeout=600)
        assert reply is not None, self.paths.log.read_text()
        return reply

    def plan(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def server():
    sockets = tempfile.mkdtemp(prefix="okps-", dir="/tmp")  # short: a Unix socket path has 107 bytes at most
    srv = Server(sockets)
    srv.spawn()
    try:
        yield srv
    finally:
        plan_server.stop(srv.paths)
        left = plan_server.holder(srv.paths)
        shutil.rmtree(sockets, ignore_errors=True)
        assert left is None, f"plan server {left} still running"


@pytest.fixture(scope="module")
def fresh():
    """One fresh full-import process, server off, started alongside the server's import: every shipped recipe to
    JSON files, then the text plan of TEXT_RECIPE on a terminal."""
    out, runs = tempfile.mkdtemp(prefix="okps-o-"), tempfile.mkdtemp(prefix="okps-a-", dir="/tmp")
    env = {**os.environ, plan_server.SWITCH: "0"}
    term = Terminal([sys.executable, "-c", FRESH, out, runs, TEXT_RECIPE, *SHIPPED], env)
    yield term, Path(out)
    if term.proc.poll() is None:
        term.proc.kill()
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(runs, ignore_errors=True)


def normalised(stdout: str) -> dict:
    """The JSON plan with its run directory reduced to the recipe's name (the time stamp and parent differ)."""
    plan = json.loads(stdout)
    plan["run_dir"] = re.sub(r"-\d{8}-\d{6}(\.\d+)?$", "", Path(plan["run_dir"]).name)
    return plan


def findings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error:", "warning:"))]


def test_every_shipped_recipe_plans_the_same_through_the_server_as_in_a_fresh_process(server, fresh, tmp_path):
    term, out = fresh
    before = server.ready()
    runs = tempfile.mkdtemp(prefix="okps-b-", dir="/tmp")  # as long as the fresh process's: same wrapping
    try:
        fast = {name: server.plan(name, "--format", "json", "--runs", runs) for name in SHIPPED}
        cmd = [sys.executable, "-m", "launch.plan", TEXT_RECIPE, "--runs", runs]
        text_rc, text = Terminal(cmd, server.env).wait(120)
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    after = server.ready()
    assert after["pong"] == before["pong"] and after["served"] == before["served"] + len(SHIPPED) + 1  # all served
    fresh_rc, fresh_text = term.wait(timeout=900)
    assert len(SHIPPED) >= 10
    for name in SHIPPED:
        want = json.loads((out / f"{name}.json").read_text())
        got = fast[name]
        assert (got.returncode, findings(got.stderr)) == (want["rc"], findings(want["stderr"])), name
        assert normalised(got.stdout) == normalised(want["stdout"]), name
    run_line = re.compile(r"run directory: \S+")
    assert text_rc == fresh_rc == 0
    assert run_line.sub("run directory: <dir>", text) == run_line.sub("run directory: <dir>", fresh_text)
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
    assert plan_server.Paths.of(other, environ=server.env).sock != server.paths.sock
    before = server.ready()
    request = plan_server._request(["llama3_8b_pretrain_8gpu_h100_bf16"], root=other)
    fds = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    try:
        reply = plan_server.ask(server.paths, request, fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert reply == {"refused": f"this server plans {ROOT}, not {other}"}
    after = server.ready()
    assert after == before  # still up, and nothing was planned


def test_bad_input_is_answered_without_a_server(tmp_path):
    sockets = tempfile.mkdtemp(prefix="okps-", dir="/tmp")
    try:
        env = {**os.environ, plan_server.DIR_VAR: sockets}
        env.pop(plan_server.SWITCH)
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "launch.plan", "llama3_8b_pretrain_8gpu_h100_bf16", "--nodes", "0"]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and out.stderr.startswith("error: NODES='0'") and len(out.stderr.splitlines()) == 1
        assert time.monotonic() - t0 < 10 and os.listdir(sockets) == []  # no server asked, none started
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_the_stamp_reads_the_real_lock_file(tmp_path):
    (tmp_path / "uv.lock").write_text("version = 1\n")
    a = plan_server.stamp(os.environ, root=tmp_path)
    (tmp_path / "uv.lock").write_text("version = 2\n")
    b = plan_server.stamp(os.environ, root=tmp_path)
    assert plan_server.differences(a, b) == "uv.lock"
    assert plan_server.differences(a, plan_server.stamp({**os.environ, "HF_HOME": "/elsewhere"}, root=tmp_path)) in (
        "$HF_HOME, uv.lock", "uv.lock, $HF_HOME")  # fmt: skip


def test_a_changed_stamp_makes_the_client_restart_the_server(server, tmp_path):
    old = server.ready()["pong"]
    client = subprocess.Popen([sys.executable, "-m", "launch.plan", "llama3_8b_pretrain_8gpu_h100_bf16", "--runs",
                               str(tmp_path)], cwd=ROOT, env={**server.env, plan_server.SALT_VAR: "another venv"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline, new = time.monotonic() + 120, None
        while time.monotonic() < deadline and (new is None or new[0] in (0, old)):
            time.sleep(0.2)
            new = plan_server.holder(server.paths)
        assert new is not None and new[0] != old, server.paths.log.read_text()
        assert not _alive(old)  # the stale server is gone: it refused the plan and exited
        log = server.paths.log.read_text()
        assert f"[{old}] stopping: the client differs in ${plan_server.SALT_VAR}" in log
    finally:
        client.kill()  # its own plan is the plain path (a full import), tested above
        client.wait()
    assert client.stderr.read() == ""  # a restart is silent


def test_make_plan_server_stop_stops_it(server):
    if plan_server.holder(server.paths) is None:
        server.spawn()
        time.sleep(1)
    held = plan_server.holder(server.paths)
    assert held is not None
    stop = ["make", "-s", "plan-server-stop"]
    first = subprocess.run(stop, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stdout.startswith(f"stopped the plan server (pid {held[0]}, was "), first
    assert plan_server.holder(server.paths) is None and not _alive(held[0])
    again = subprocess.run(stop, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120)
    assert again.stdout == "no plan server was running for this checkout\n"


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie awaiting its parent, this pytest, has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
