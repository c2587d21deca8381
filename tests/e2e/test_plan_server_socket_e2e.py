"""What is at the plan server's socket path is checked before anything is sent (src/overlapkit/serve/paths.py:
socket_problem, peer_problem): a regular file or a symbolic link there is never connected to nor removed, a socket
whose listener is not the server holding the checkout's lock is sent nothing (a request carries the whole
environment, tokens included), and each says in one `note:` line that the fast path is not taken. Clients run in new
processes, as a `make plan` does, with a fake secret in their environment; the listeners are this test's own."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from overlapkit import stack
from overlapkit.serve import paths as serve_paths
from overlapkit.serve import server as serve_server

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
SECRET = "okps-fake-wandb-key-that-must-not-travel"
# The client's side of a good `make plan`: forward() asks the server, and successor_paths() says whether this
# process would become the next server once its own plan is done (run() does both around the plan itself).
CLIENT = (
    "import json; from overlapkit.serve import client\n"
    f"code = client.forward([{R8!r}], 'launch.plan')\n"
    "print(json.dumps({'forwarded': code, 'would_serve': client.successor_paths() is not None}))\n"
)


@pytest.fixture
def paths():
    """A private socket directory of its own, short (a socket path has 107 bytes at most), with no server."""
    d = tempfile.mkdtemp(prefix="okps-", dir="/tmp")
    try:
        yield serve_paths.Paths.of(environ={serve_paths.DIR_VAR: d})
    finally:
        shutil.rmtree(d, ignore_errors=True)


def client(paths) -> tuple[dict, list[str]]:
    """The client in a new process: (what it did, its stderr lines)."""
    env = {**os.environ, serve_paths.DIR_VAR: str(paths.dir), "WANDB_API_KEY": SECRET}
    env.pop(serve_paths.SWITCH, None)
    out = subprocess.run(
        [sys.executable, "-c", CLIENT], cwd=stack.REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr.splitlines()


def listener(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(4)
    s.settimeout(0.5)
    return s


def received(lsn: socket.socket) -> bytes | None:
    """What reached the listener: None when nobody connected, else every byte sent before the client closed."""
    try:
        conn, _ = lsn.accept()
    except TimeoutError:
        return None
    with conn:
        conn.settimeout(5)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data


def test_a_regular_file_at_the_socket_path_is_reported_and_left_alone(paths):
    paths.sock.write_text("someone's notes\n")
    did, err = client(paths)
    assert did == {"forwarded": None, "would_serve": False}  # planned here; no server that would fail to bind
    assert err == [
        f"note: plan server not used: {paths.sock} is a regular file, not the server's socket; left as it is: "
        "remove it, and a server starts again; running in this process"
    ]
    assert paths.sock.read_text() == "someone's notes\n"


def test_a_symlink_at_the_socket_path_is_never_followed(paths):
    other = paths.dir / "other.sock"
    with listener(other) as lsn:
        paths.sock.symlink_to(other)
        did, err = client(paths)
        assert received(lsn) is None  # not even connected to
    assert did == {"forwarded": None, "would_serve": False}
    assert len(err) == 1 and err[0].startswith(f"note: plan server not used: {paths.sock} is a symbolic link")
    assert paths.sock.is_symlink()


def test_a_listener_that_is_not_the_lock_holder_is_sent_nothing(paths):
    """A socket at the path, but its listener (this test) is not the pid in the server's lock: nothing is sent."""
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.pwrite(lock, b"1 ready", 0)  # a server (pid 1, say) holds the lock; the socket is not its
        with listener(paths.sock) as lsn:
            did, err = client(paths)
            data = received(lsn)
    finally:
        os.close(lock)
    assert data == b"" and SECRET.encode() not in data  # connected, checked, closed: not a byte of the request
    assert did == {"forwarded": None, "would_serve": False}  # the lock holder would serve next, not this process
    assert err == [
        f"note: plan server not used: the listener on {paths.sock} is pid {os.getpid()}, and the server holding "
        f"{paths.lock} is pid 1: nothing sent; running in this process"
    ]


def _server(paths) -> serve_server.Server:
    env, path = dict(os.environ), list(sys.path)
    return serve_server.Server(paths, -1, env, path, serve_paths.stamp(env, path), {})


def test_a_server_replaces_only_a_socket_and_stops_when_its_own_is_replaced(paths):
    paths.sock.write_text("someone's notes\n")
    with pytest.raises(OSError, match="is a regular file, not the server's socket"):
        _server(paths).bind()
    assert paths.sock.read_text() == "someone's notes\n"
    paths.sock.unlink()
    server = _server(paths)
    server.bind()
    try:
        assert server.why_stale() == ""
        paths.sock.unlink()
        paths.sock.write_text("put here while it served\n")
        assert server.why_stale() == f"its socket {paths.sock} was removed or replaced"  # the minute check stops it
    finally:
        server.close_listener()
    assert paths.sock.read_text() == "put here while it served\n"  # what replaced its socket is not removed
