"""The plan server's lock file, the one file the server itself writes (its pid, under flock): opened in place, never
through a link planted at its name (a link would have the server truncate and overwrite the link's target)."""

from __future__ import annotations

import fcntl

import pytest

from launch import plan_server, serve
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
