"""Where the plan server's socket lives, refused when it is not the user's own, in one line that names why (the
link and its target, the owner, the mode): the directory, and the listener at the socket path (its uid, from the
kernel, before a byte is sent: a request carries the whole environment, tokens included). In this process: none of
it needs Bridge or a server."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from overlapkit.cluster import plan_server
from overlapkit.errors import BadInput

NOBODY = 65534


def test_a_fresh_directory_is_made_private(tmp_path):
    sock, _, _ = plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})
    d = sock.parent
    assert d == tmp_path / "s" and (os.stat(d).st_mode & 0o777) == 0o700


def test_a_planted_link_is_refused_naming_the_link_and_its_target(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "s").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadInput, match=rf"^{tmp_path / 's'} is a symbolic link to {tmp_path / 'elsewhere'}, never"):
        plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_another_users_directory_is_refused_naming_the_owner(tmp_path):
    (tmp_path / "s").mkdir(mode=0o700)
    os.chown(tmp_path / "s", NOBODY, NOBODY)
    with pytest.raises(BadInput, match=r"belongs to user nobody, not to you: remove it, or set OVERLAPKIT_PLAN_"):
        plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})


def test_a_directory_open_to_others_is_refused_with_its_mode(tmp_path):
    (tmp_path / "s").mkdir()
    os.chmod(tmp_path / "s", 0o777)
    with pytest.raises(BadInput, match=r"is not a directory private to you \(mode 777\)"):
        plan_server.paths({plan_server.DIR_VAR: str(tmp_path / "s")})


@pytest.mark.skipif(os.getuid() != 0, reason="a listener of another user needs root")
def test_a_listener_of_another_user_is_sent_nothing():
    where = Path(tempfile.mkdtemp(prefix="okps-", dir="/tmp"))  # a directory another user can reach
    os.chmod(where, 0o777)
    sock = where / "other.sock"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user's listener: what it receives goes to the pipe
        try:
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(sock))
                os.chmod(sock, 0o777)
                s.listen(1)
                conn, _ = s.accept()
                os.write(w, conn.recv(1 << 16) or b"nothing")
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    reply = plan_server.ask(Path(sock), {"env": {"WANDB_API_KEY": "must-not-travel"}})
    assert reply == {"declined": f"the listener on {sock} runs as uid {NOBODY}, not as you: nothing sent"}
    os.waitpid(pid, 0)
    assert os.read(r, 1 << 16) == b"nothing"
    shutil.rmtree(where)


@pytest.mark.parametrize(
    ("cluster", "environ", "on"),
    [
        ("local", {}, True),  # a developer's machine: its profile says plan_server = true
        ("example-eos", {}, False),  # a cluster's login node: off unless asked for
        ("example-eos", {plan_server.SWITCH: "1"}, True),
        ("local", {plan_server.SWITCH: "0"}, False),
        ("local", {plan_server.SWITCH: "1", "SLURM_JOB_ID": "7"}, False),  # never inside a job
        ("nosuch", {}, False),  # the command itself says what is wrong with CLUSTER=
    ],
)
def test_the_profile_decides_unless_the_switch_does(cluster, environ, on):
    assert plan_server.wanted(SimpleNamespace(cluster=cluster), environ) is on


def test_plan_server_in_a_profile_is_true_or_false(tmp_path):
    from overlapkit.cluster.profiles import load_profile

    (tmp_path / "p.toml").write_text('account = "a"\npartition = "p"\nplan_server = "yes"\n')
    with pytest.raises(BadInput, match=r"plan_server = 'yes': expected true or false"):
        load_profile(tmp_path / "p.toml")
