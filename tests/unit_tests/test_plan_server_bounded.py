"""The plan server cannot hang its clients or pile up (the hostile sweep's P008, P011, P012, P017, P018, P020, P022,
S006, S008, S011): a client waits a bounded time for a server to take its command, then runs it itself, and a worker
never runs a command its client gave up on; workers are reaped as they end and never more than max_children at once;
the plan-server variables are understood or refused in one line; the Makefile's data variables (TORCH_PROFILE, NSYS)
never make a client "another stack". In process, with a real Server that skips the Bridge preload (load=dict), run in
a forked child of this process."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch import commands, serve
from overlapkit import jsonio, paths
from overlapkit.cluster import plan_server
from overlapkit.errors import BadInput

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def children(pid: int) -> list[str]:
    """The states (R, S, Z, ...) of `pid`'s children."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(fields[0])
    return out


@contextlib.contextmanager
def a_server(tmp_path: Path, max_children: int | None = None):
    """A real Server (no preload) serving in a forked child: (socket, its pid)."""
    sock, lock, _ = plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})
    pid = os.fork()
    if pid == 0:  # the server
        try:
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # not pytest's capture
            fd = jsonio.open_lock(lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid():<12}".encode())
            server = serve.Server(sock, fd, 60.0, load=dict)
            server.max_children = max_children or server.max_children
            while not server.done:
                server.handle_request()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield sock, pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def probe(sock: Path, timeout: float = 10) -> socket.socket:
    """A connection to `sock`, as a client makes it (its wait on a full backlog bounded by `timeout`)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(timeout)
    plan_server.connect(conn, sock, time.monotonic() + timeout)
    return conn


def test_sequential_commands_leave_no_zombie_workers(tmp_path):  # P012: 40 plans left 40 zombies for 30 s
    with a_server(tmp_path) as (sock, pid):
        for _ in range(20):  # 20 commands, one after the other (a plan loop)
            with probe(sock) as conn:  # a client that only checks the server listens: its worker ends at once
                conn.shutdown(socket.SHUT_WR)
                assert conn.recv(1) == b""  # its worker has ended (it closed the connection)
        time.sleep(1.5)  # a worker that ended is reaped within Server.timeout (0.5 s), not after 30 s idle
        assert children(pid).count("Z") == 0, children(pid)


def test_a_flood_never_has_more_workers_than_max_children(tmp_path):  # P011: 50 plans had 65 children at once
    with a_server(tmp_path, max_children=6) as (sock, pid):  # socketserver's 40, made 6: fewer forks to wait for
        r, w = os.pipe()
        clients = []
        for _ in range(12):  # each worker blocks, waiting for a request that never comes
            with contextlib.suppress(OSError):
                conn = probe(sock, timeout=0.5)
                socket.send_fds(conn, [b"\0"], [r, w, w])
                clients.append(conn)
        time.sleep(2)
        assert 1 <= len(children(pid)) <= 6
        for conn in clients:
            conn.close()
        os.close(r)
        os.close(w)
        # The connections still in the backlog are each taken in turn, by a worker of their own that ends at once:
        # between two, no worker lives. A last client, taken after all of them (the backlog is first in, first
        # out), is the sign that no connection is left to take.
        with probe(sock, timeout=30) as last:
            last.shutdown(socket.SHUT_WR)
            assert last.recv(1) == b""  # its worker has ended
        deadline = time.monotonic() + 30
        while children(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children(pid) == []  # each ended with its client, and was reaped


def _request(tmp_path: Path) -> dict:
    log = tmp_path / "t.log"
    log.write_text(" iteration        1/       2 | elapsed time per iteration (ms): 10.0 | nan iterations: 0 |\n")
    _, args, _ = commands.prepare("parse-log", [str(log)])
    env = {k: v for k, v in os.environ.items() if k != "OVERLAPKIT_MAKE_PID"}
    return dict(name="parse-log", args=args, env=env, cwd=os.getcwd(), umask=0o22, stamp=plan_server.stamp(env))


@pytest.mark.parametrize("go", [True, False])
def test_a_worker_runs_a_command_only_once_its_client_says_go(tmp_path, go):
    """A client that gave up waiting runs the command itself: the worker that then says "accepted" must not."""
    with a_server(tmp_path) as (sock, _):
        r, w = os.pipe()
        conn = probe(sock, timeout=20)
        socket.send_fds(conn, [b"\0"], [w, w, w])
        os.close(w)
        conn.sendall(pickle.dumps(_request(tmp_path)))
        replies = conn.makefile("rb")
        assert "accepted" in pickle.load(replies)
        if go:
            conn.sendall(b"go")
            assert pickle.load(replies) == {"rc": 0}
        replies.close()
        conn.close()
        out = b""
        while chunk := os.read(r, 1 << 16):  # EOF once the worker ended
            out += chunk
        os.close(r)
    assert (b'"iteration": 1' in out) is go, out


def _stuck_listener(tmp_path: Path, backlog_full: bool):
    """A server that holds the lock and listens but never takes a command (SIGSTOP, a stat stuck on NFS)."""
    sock, lock, _ = plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})
    fd = jsonio.open_lock(lock)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid():<12}".encode())
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(0)
    held = []
    while backlog_full:  # connect() itself now blocks
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(str(sock))
            held.append(c)
        except BlockingIOError:
            c.close()
            break
    return sock, [listener, *held], fd


@pytest.mark.parametrize("backlog_full", [False, True])
def test_a_server_that_never_takes_the_command_is_passed_by_in_seconds(tmp_path, monkeypatch, capsys, backlog_full):
    """P022: a stopped or hung server hung every client forever; now the client waits ACCEPT_S, says so in one
    line naming the fix, starts no other server, and runs the command itself."""
    sock, held, fd = _stuck_listener(tmp_path, backlog_full)
    monkeypatch.setenv(plan_server.DIR_VAR, str(tmp_path / "s"))
    monkeypatch.setenv(plan_server.SWITCH, "1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(plan_server, "started", lambda *a: pytest.fail("another server started"))
    t0 = time.monotonic()
    try:
        assert plan_server.forward("recipes", SimpleNamespace(cluster="local")) is None  # None: run it here
    finally:
        for s in held:
            s.close()
        os.close(fd)
    assert time.monotonic() - t0 < plan_server.ACCEPT_S + 2
    err = capsys.readouterr().err
    assert err == (
        f"note: plan server not used: the plan server (pid {os.getpid()}) did not take this command within "
        f"{plan_server.ACCEPT_S:g} s (stopped or hung? make plan-server-stop ends it); running in this process\n"
    )


@pytest.mark.parametrize(("typed", "seconds"), [("", 900.0), ("60", 60.0), (" 1.5 ", 1.5)])
def test_the_idle_value_in_seconds(typed, seconds):
    assert plan_server.idle_seconds({plan_server.IDLE_VAR: typed}) == seconds


@pytest.mark.parametrize("typed", ["abc", "nan", "inf", "-5", "0", "1e3", "9" * 5000, "١٢"])
def test_a_bad_idle_value_is_one_line_before_any_server(tmp_path, monkeypatch, capsys, typed):
    """P017 (abc crashed each server after its import) and P018 (nan never idled out): refused by the client, exit 2,
    and by a server started by hand before its import."""
    monkeypatch.setenv(plan_server.IDLE_VAR, typed)
    monkeypatch.setenv(plan_server.SWITCH, "1")
    monkeypatch.setenv(plan_server.DIR_VAR, str(tmp_path / "s"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(plan_server, "started", lambda *a: pytest.fail("a server started"))
    assert commands.main(["recipes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {plan_server.IDLE_VAR}=") and err.count("\n") == 1, err
    assert "seconds a server waits for a command, e.g. 900" in err
    sock, lock, _ = plan_server.paths()
    with pytest.raises(BadInput, match=plan_server.IDLE_VAR):
        serve.serve(sock, lock)
    assert not sock.exists()


@pytest.mark.parametrize(
    ("typed", "on"), [("yes", True), ("On", True), ("true", True), ("no", False), ("off", False), ("", True)]
)
def test_the_switch_takes_the_yes_no_words(typed, on):  # P020: yes/true/on fell back to the profile silently
    assert (
        plan_server.wanted(SimpleNamespace(cluster="example-eos" if typed else "local"), {plan_server.SWITCH: typed})
        is on
    )


@pytest.mark.parametrize("typed", ["maybe", "2", "y"])
def test_a_switch_that_is_neither_is_one_line(monkeypatch, capsys, typed):
    monkeypatch.setenv(plan_server.SWITCH, typed)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert commands.main(["recipes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {plan_server.SWITCH}={typed!r}: {typed!r} is neither on (1, true, yes, on)")
    assert err.count("\n") == 1


def test_a_server_directory_that_is_a_file_is_named(tmp_path):  # P008: "[Errno 17] File exists"
    (tmp_path / "psd-file").write_text("")
    with pytest.raises(BadInput, match=rf"^{tmp_path / 'psd-file'} is a file, not a directory: remove it, or set"):
        plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "psd-file")})


STAMP_PROBE = (
    f"{sys.executable} -c 'import os; from overlapkit.cluster import plan_server as p; "
    "print(p.digest(p.stamp(os.environ)))'"
)


def _stamp_under_make(*variables: str, env=None) -> str:
    out = subprocess.run(
        ["make", "-s", "plan", f"RECIPE={R8}", *variables, f"PY={STAMP_PROBE}"],
        cwd=paths.REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_makefiles_data_variables_never_make_another_stack():
    """S006/S008/S011: TORCH_PROFILE* matched the "TORCH" import prefix, so every profiled command stopped the
    user's server and ran in its own process (~30 s) with a note blaming the client's stack. Through make: the
    variables make hands over as arguments leave the stamp as it is; a variable torch reads at import does not."""
    plain = _stamp_under_make()
    assert _stamp_under_make("TORCH_PROFILE=3:5", "TORCH_PROFILE_RANKS=0,1", "NSYS_RANKS=1") == plain
    assert _stamp_under_make(env={"TORCH_PROFILE": "3:5"}) == plain  # exported in the shell: still make's variable
    assert _stamp_under_make(env={"TORCH_LOGS": "+dynamo"}) != plain


def test_what_differs_is_named():
    env = {"TORCH_LOGS": "+dynamo", "HF_HOME": "/a"}
    server = plan_server.stamp(env)
    assert plan_server.differs(plan_server.stamp(env), server) == ""
    client = plan_server.stamp({**env, "TORCH_LOGS": "", "CUDA_VISIBLE_DEVICES": "0"})
    assert plan_server.differs(client, server) == (
        "the client's stack differs from the server's (import-time variables CUDA_VISIBLE_DEVICES, TORCH_LOGS)"
    )
