"""The plan server (its client overlapkit/cluster/plan_server.py, the server launch/serve.py) as `make` uses it, in
new processes, in a directory of this module's own: a served plan prints and writes what the plain path does (JSON
and the text on a terminal), with the client's umask and TMPDIR; an edited recipe shows in the next served plan; a
stale client stops it; kill -9 of the server or of the client leaves no worker behind, and a command the server
accepted is never run twice; with the server off nothing is left running. Whether the server is on for the rest of
the suite does not matter here.

The recipe these tests plan is written into their own RECIPES_PATH directory: it builds Llama3 8B and, when asked
through the environment, records what its process sees (PROBE) or blocks reading a FIFO (a command that is slow).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import resource
import shlex
import signal
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from launch import commands, serve
from overlapkit import paths
from overlapkit.bridge import registry
from overlapkit.cluster import plan_server

ROOT = paths.REPO_ROOT
NAME = "llama3_8b_pretrain_8gpu_h100_bf16_okps"
RECIPE = """
import json, os, tempfile

from megatron.bridge.recipes.llama import llama3_8b_pretrain_config as base

from recipes._base import Layout, h100_pretrain, register


@register(model="Llama3 8B", nodes=1, source="tests/e2e/test_plan_server_e2e.py")
def llama3_8b_pretrain_8gpu_h100_bf16_okps():
    if probe := os.environ.get("OKPS_PROBE"):  # what this process sees, one line per build
        mask = os.umask(0)
        os.umask(mask)
        seen = dict(pid=os.getpid(), ppid=os.getppid(), umask=mask, tmp=tempfile.gettempdir())
        with open(probe, "a") as f:
            f.write(json.dumps(seen) + "\\n")
    if os.environ.get("OKPS_BUG"):  # a bug in what the command runs
        raise KeyError("okps")
    if fifo := os.environ.get("OKPS_FIFO"):
        open(fifo).read()  # blocks until someone writes: a slow command
    return h100_pretrain(base, "bf16", Layout(tp=1, pp=1, cp=2, vpp=None, mbs=1, gbs={gbs}, seq=8192))
"""
COLS = 100  # not the 120 a pipe gets: the terminal's own width must reach rich through the passed descriptors
# The run directory's stamp (20261206-053708, .N on a collision), where the terminal may wrap its line: between any
# two of its characters (a pytest-xdist worker's longer temporary path put a wrap in it: "20261206-0\r\n53708")
STAMP = re.compile("(?:\r\n)?".join([r"\d"] * 8 + ["-"] + [r"\d"] * 6) + r"(\.\d+)?")


class Served:
    """The environment of this module's clients, and their server's socket, lock and log."""

    def __init__(self, tmp: Path):
        self.recipes, self.runs = tmp / "recipes", tmp / "runs"
        self.recipes.mkdir()
        self.write(gbs=128)
        switch = {plan_server.SWITCH: "1", plan_server.DIR_VAR: str(tmp / "s"), "RECIPES_PATH": str(self.recipes)}
        self.env = {**os.environ, **switch}
        self.sock, self.lock, self.log = plan_server.paths(self.env)

    def write(self, gbs: int) -> None:
        (self.recipes / "okps.py").write_text(RECIPE.replace("{gbs}", str(gbs)))

    def argv(self, *extra: str) -> list[str]:
        """What `make plan RECIPE=<the test recipe> FORMAT=json` runs, its run directory in this module's."""
        return [sys.executable, "-m", "launch", "plan", NAME, "--format", "json", "--runs", str(self.runs), *extra]

    def plan(self, shell: str = "", **env) -> subprocess.CompletedProcess:
        """A plan of the test recipe in a new process, after `shell` (a umask, a ulimit) in the same shell."""
        return subprocess.run(
            ["bash", "-c", shell + shlex.join(self.argv())],
            cwd=ROOT,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=900,
        )

    def pid(self) -> int:
        """The server's pid, started by a first (cold) plan when none runs (or the last one is still going: killed
        by a test before this one, its lock not yet let go)."""
        if (pid := plan_server.holder(self.lock)) is not None and gone(pid, timeout=0.5):
            assert released(self.lock)
        if plan_server.holder(self.lock) is None:
            out = self.plan()
            assert out.returncode == 0, out.stderr[-3000:]
        assert (pid := plan_server.holder(self.lock)) is not None, self.log.read_text()[-3000:]
        return pid

    def slow(self, tmp: Path, under_make: bool = False) -> tuple[subprocess.Popen, dict]:
        """A served plan that blocks reading a FIFO once it runs: (its process, what its worker saw). `under_make`:
        its parent is a shell standing in for make (the process is that shell; OVERLAPKIT_MAKE_PID its pid)."""
        fifo, probe = tmp / "fifo", tmp / "probe.jsonl"
        os.mkfifo(fifo)
        env = {**self.env, "OKPS_FIFO": str(fifo), "OKPS_PROBE": str(probe)}
        argv = ["bash", "-c", f"OVERLAPKIT_MAKE_PID=$$ {shlex.join(self.argv())}; true"] if under_make else self.argv()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not probe.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe.is_file(), proc.communicate(timeout=60)
        return proc, json.loads(probe.read_text().splitlines()[0])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("okps"))
    # The plain path on a terminal (plain_on_a_terminal), begun now: its Bridge import runs beside the server's first.
    off = {plan_server.SWITCH: "0", plan_server.DIR_VAR: str(tmp_path_factory.mktemp("plain") / "off")}
    s.plain = Terminal(terminal_argv(s), {**s.env, **off}), Path(off[plan_server.DIR_VAR])
    yield s
    if pid := plan_server.holder(s.lock):
        os.kill(pid, signal.SIGTERM)
    if s.plain[0].proc.poll() is None:  # no test read it
        s.plain[0].proc.kill()


# How long a process may take to end. Generous: the suite's other worker and the night's 64-rank jobs share the two
# CPUs (a .ci/run saw a stopped server still there after 20 s while they ran); a process that never ends still fails.
ENDS_S = 90


def gone(pid: int, timeout: float = ENDS_S) -> bool:
    """Has `pid` exited (or become a zombie) within `timeout` seconds?"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.1)
    return False


def what(pid: int) -> str:
    """What `pid` is doing, for a failure's message: its state and the kernel function it waits in."""
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return f"pid {pid} state {state}, waiting in {Path(f'/proc/{pid}/wchan').read_text()}"
    return f"pid {pid} gone"


def released(lock: Path, timeout: float = ENDS_S) -> bool:
    """Is `lock` free within `timeout` seconds? (A process's files close after its main thread shows as a zombie.)"""
    deadline = time.monotonic() + timeout
    while plan_server.holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return plan_server.holder(lock) is None


def normalised(stdout: str) -> dict:
    """The JSON plan with its run directory reduced to the recipe's name (the time stamp and parent differ)."""
    plan = json.loads(stdout)
    plan["run_dir"] = re.sub(r"-\d{8}-\d{6}(\.\d+)?$", "", Path(plan["run_dir"]).name)
    return plan


def test_a_served_plan_is_the_plain_plan_made_with_the_clients_umask_and_tmpdir(served, tmp_path, capsys):
    pid, probe = served.pid(), tmp_path / "probe.jsonl"
    tmpdir = tmp_path / "my tmp"
    tmpdir.mkdir()
    out = served.plan("umask 077; ", TMPDIR=str(tmpdir), OKPS_PROBE=str(probe))
    assert out.returncode == 0, out.stderr
    (seen,) = [json.loads(line) for line in probe.read_text().splitlines()]
    assert seen["ppid"] == pid == plan_server.holder(served.lock)  # served: built in a worker of the server
    assert (seen["umask"], seen["tmp"]) == (0o077, str(tmpdir))
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    assert stat.S_IMODE((run_dir / "plan.json").stat().st_mode) == 0o600  # written with the client's umask
    os.environ["RECIPES_PATH"] = str(served.recipes)  # the plain path, in this process (isolated_environ restores)
    try:
        if NAME not in registry.names():  # this process discovered its recipes before RECIPES_PATH was set
            registry.load_file(served.recipes / "okps.py", NAME)
        capsys.readouterr()
        assert commands.call("plan", served.argv()[4:]) == 0
    finally:
        registry.unregister(NAME)
        sys.modules.pop("recipes.okps", None)
    assert normalised(capsys.readouterr().out) == normalised(out.stdout)


def test_a_bug_in_a_served_command_shows_its_traceback_and_exits_1(served):
    pid = served.pid()
    out = served.plan(OKPS_BUG="1")
    assert out.returncode == 1 and "note:" not in out.stderr, out.stderr  # served, not run again in the client
    assert "Traceback (most recent call last)" in out.stderr and out.stderr.rstrip().endswith("KeyError: 'okps'")
    assert plan_server.holder(served.lock) == pid  # the server serves on


def test_an_edited_recipe_shows_in_the_next_served_plan(served):
    pid, gbs = served.pid(), []
    for value in (256, 1024, 128):  # another length too: a .pyc is trusted when the size and the second agree
        served.write(gbs=value)
        out = served.plan()
        assert out.returncode == 0, out.stderr
        gbs.append(json.loads(out.stdout)["layout"]["gbs"])
    assert gbs == [256, 1024, 128] and plan_server.holder(served.lock) == pid  # the same server, no restart


class Terminal:
    """`argv` with its stdin/stdout/stderr a terminal COLS wide (a forked child when argv is a function)."""

    def __init__(self, argv, env: dict):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLS, 0, 0))
        env = {k: v for k, v in env.items() if k not in ("COLUMNS", "NO_COLOR")} | {"TERM": "xterm-256color"}
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env, start_new_session=True
        )
        os.close(slave)
        self.master, self.out = master, bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # EIO: every writer has closed the terminal
            while chunk := os.read(self.master, 65536):
                self.out += chunk

    def text(self, timeout: float = 300) -> str:
        assert self.proc.wait(timeout=timeout) == 0, self.out.decode()[-3000:]
        self.reader.join(timeout=30)
        os.close(self.master)
        return STAMP.sub("<time>", self.out.decode())


def terminal_argv(served: Served) -> list[str]:
    return [a for a in served.argv() if a not in ("--format", "json")]


@pytest.fixture(scope="module")
def plain_on_a_terminal(served):
    """The plain path on a terminal, the server off, its directory one of its own (a Bridge import in a new process,
    begun with `served`, shared by the two tests that read it): (what it printed, that directory)."""
    terminal, off = served.plain
    return terminal.text(), off


def test_a_served_plan_on_a_terminal_prints_what_the_plain_path_prints(served, plain_on_a_terminal):
    served.pid()
    fast = Terminal(terminal_argv(served), served.env).text()
    plain, _ = plain_on_a_terminal
    assert fast == plain
    assert "\x1b[" in fast and max(len(re.sub(r"\x1b\[[0-9;]*m", "", line)) for line in fast.splitlines()) <= COLS


def test_a_client_of_another_stack_stops_the_server_and_runs_its_command_itself(served):
    pid = served.pid()
    reply = plan_server.ask(served.sock, {"name": "plan", "args": None, "stamp": "another interpreter or environment"})
    assert reply and "differs" in reply["declined"]
    assert gone(pid), what(pid)
    assert released(served.lock)  # its lock went with it


def test_other_resource_limits_are_another_stack():
    """sbatch hands the submitting process's limits to the job: a client whose limits differ is never served by a
    server started under others (its stamp differs, which stops that server: the test above)."""
    before = plan_server.stamp(os.environ)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 777) - 1, hard))
    try:
        assert plan_server.stamp(os.environ) != before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert plan_server.stamp(os.environ) == before


def test_kill_9_of_the_server_ends_its_worker_and_the_command_is_not_run_again(served, tmp_path):
    served.pid()
    client, seen = served.slow(tmp_path)
    os.kill(seen["ppid"], signal.SIGKILL)  # the server, mid-command
    assert gone(seen["pid"])  # its worker ended with it (PR_SET_PDEATHSIG), not left under init
    _, err = client.communicate(timeout=60)
    assert client.returncode == 128 + signal.SIGTERM, err
    assert "the plan server stopped during this command" in err.decode()
    assert len((tmp_path / "probe.jsonl").read_text().splitlines()) == 1  # run once: never again in the client


@pytest.mark.parametrize("killed", ["client", "make"])
def test_a_worker_blocked_on_a_fifo_ends_when_its_client_or_make_is_killed(served, tmp_path, killed):
    pid = served.pid()
    proc, seen = served.slow(tmp_path, under_make=killed == "make")
    os.kill(proc.pid, signal.SIGKILL)  # make: its client hears of it (overlapkit/makewatch.py) and ends
    assert gone(seen["pid"]), f"worker {seen['pid']} still runs"
    assert plan_server.holder(served.lock) == pid  # the server itself serves on
    proc.wait()


def test_with_the_server_off_none_is_asked_or_started(plain_on_a_terminal):
    printed, off = plain_on_a_terminal  # exited 0 (Terminal.text); stdout and stderr are the one terminal
    assert "note:" not in printed, printed[-3000:]
    assert not off.exists()  # not even its directory: nothing can be left running


def test_an_idle_server_exits():
    server = serve.Server.__new__(serve.Server)  # its idleness rule alone: no socket, no preload
    server.active_children, server.idle, server.files, server.done = None, 60, {}, ""
    server.checked = time.monotonic()
    server.last = time.monotonic() - 61
    server.handle_timeout()
    assert server.done == "idle for 60 s"
    server.last, server.done = time.monotonic(), ""
    server.handle_timeout()
    assert server.done == ""


def test_make_plan_server_stop_stops_it(served):
    pid = served.pid()
    out = subprocess.run(
        ["make", "-s", "plan-server-stop"], cwd=ROOT, env=served.env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith(f"stopped the plan server (pid {pid}; log "), out.stderr
    assert gone(pid) and plan_server.holder(served.lock) is None
