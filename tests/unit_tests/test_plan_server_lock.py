"""The files the plan server writes, its lock (its pid, under flock) and its log (its output, appended by the client
that starts it): each opened in place, never through a link planted at its name (a link would have the server
truncate, overwrite or append to the link's target)."""

from __future__ import annotations

import fcntl
import os
import signal

import pytest

from launch import commands, serve
from overlapkit import makewatch
from overlapkit.cluster import plan_server
from overlapkit.errors import BadInput


def test_the_servers_lock_is_never_written_through_a_planted_link(tmp_path, monkeypatch):
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(plan_server.DIR_VAR, str(d))
    sock, lock, _ = plan_server.paths()
    target = tmp_path / "precious"
    target.write_text("keep")
    lock.symlink_to(target)
    with open(target) as held:  # a server that followed the link would find this flock and return 0 (not serve)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BadInput, match=f"{lock} is a symbolic link to {target}, never followed: remove it"):
            serve.serve(sock, lock)
    assert target.read_text() == "keep" and lock.is_symlink()


def test_the_servers_log_is_never_written_through_a_planted_link(tmp_path, monkeypatch, capsys):
    """A served command whose server must be started, with a link to a file outside planted at the log's name: no
    server starts, the note names the link and its target, the command runs in this process, the file is untouched."""
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(plan_server.DIR_VAR, str(d))
    monkeypatch.setenv(plan_server.SWITCH, "1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # inside a job no server is used
    monkeypatch.delenv(makewatch.MAKE_PID, raising=False)
    sock, lock, log = plan_server.paths()
    target = tmp_path / "precious"
    target.write_text("keep")
    log.symlink_to(target)
    _, args, bridge = commands.prepare("recipes", [])
    assert bridge  # a command the server would run
    try:
        assert plan_server.forward("recipes", args) is None  # None: run it in this process
    finally:
        if pid := plan_server.holder(lock):  # a server that started through the link: stopped
            os.kill(pid, signal.SIGTERM)
    err = capsys.readouterr().err
    assert f"plan server not used: {log} is a symbolic link to {target}, never followed: remove it" in err
    assert target.read_text() == "keep" and log.is_symlink() and not sock.exists()
