"""Shared test set-up: Bridge is imported once per pytest process (≈30 s on CPU), offline, with the TE shim."""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch import plan_server
from overlapkit import stack

# No test leaves a plan server behind, and none uses yours: a process a test starts plans by itself unless the test
# asks for the session's server (the `served` fixture: one server in a private directory, started as soon as the
# collection shows a test that needs it, stopped at the end; launch/plan_server.py).
os.environ[plan_server.SWITCH] = "0"
stack.import_bridge()
SESSION_SERVER = plan_server.Paths(Path(tempfile.mkdtemp(prefix="okps-", dir="/tmp")), "")  # short: socket paths


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _slurm_running() -> str | None:
    """None when the local Slurm answers, else the reason it is skipped."""
    if shutil.which("sinfo") is None:
        return "Slurm client not installed (run: bash slurm/local/install.sh && bash slurm/local/start.sh)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld is not answering (bash slurm/local/start.sh)"
    if out.returncode != 0 or "idle" not in out.stdout and "mix" not in out.stdout and "alloc" not in out.stdout:
        return f"local Slurm not running: {out.stderr.strip() or out.stdout.strip()} (bash slurm/local/start.sh)"
    return None


def served_env() -> dict:
    """The environment of a process that uses the session's plan server."""
    env = {**os.environ, plan_server.DIR_VAR: str(SESSION_SERVER.dir)}
    env.pop(plan_server.SWITCH, None)
    return env


def start_session_server() -> None:
    """Spawn the session's server (as a first `make plan` would, without the plan beside it) unless one holds it."""
    paths = plan_server.Paths.of(environ=served_env())
    if plan_server.holder(paths) is None:
        with open(paths.log, "a") as log:
            subprocess.Popen(
                [sys.executable, "-m", "launch.plan_server", "--serve"],
                cwd=stack.REPO_ROOT,
                env=served_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


@pytest.fixture(scope="session")
def served():
    """The session's plan server, ready: the environment for processes that should use it. One Bridge import serves
    every `make` the e2e tests type and the unit tests' new processes."""
    start_session_server()
    paths = plan_server.Paths.of(environ=served_env())
    assert plan_server.wait_ready(paths, timeout=600) is not None, paths.log.read_text()[-3000:]
    return served_env()


# The night every test that reads a preflight-only nightly shares (the nightly e2e, the 70B run of the Slurm e2e):
# `make nightly CLUSTER=local PREFLIGHT=1` typed once, in the background from the collection on, served.
NIGHT = {"dir": Path(tempfile.mkdtemp(prefix="okpn-", dir="/tmp"))}  # /tmp: every fake node sees it
WAIT_READY = "from launch import plan_server as s; s.wait_ready(s.Paths.of(), 600)"


def start_night() -> None:
    jobs, cmd = NIGHT["dir"] / "jobs", ["make", "nightly", "CLUSTER=local", "PREFLIGHT=1"]
    script = f"{sys.executable} -c '{WAIT_READY}'; exec {' '.join(cmd)} JOB_DIR={jobs}"
    out, err = open(NIGHT["dir"] / "stdout", "w"), open(NIGHT["dir"] / "stderr", "w")
    NIGHT["proc"] = subprocess.Popen(
        ["bash", "-c", script], cwd=stack.REPO_ROOT, env=served_env(), stdout=out, stderr=err, stdin=subprocess.DEVNULL
    )
    NIGHT["jobs"] = jobs


@pytest.fixture(scope="session")
def preflight_night(served):
    """The shared night once `make nightly` has returned: (CompletedProcess, JOB_DIR). Its jobs may still run."""
    if "proc" not in NIGHT:
        start_night()
    proc = NIGHT["proc"]
    proc.wait(timeout=900)
    out = subprocess.CompletedProcess(
        proc.args, proc.returncode, *((NIGHT["dir"] / name).read_text() for name in ("stdout", "stderr"))
    )
    return out, NIGHT["jobs"]


def pytest_collection_modifyitems(config, items):
    # Unit tests first, the e2e tests after them, and the tests that stop the session's server last: what the e2e
    # tests start early (the server, the nightly) runs on the second core while the unit tests run on the first.
    items.sort(key=lambda i: ("/e2e/" in str(i.path), "stops_server" in i.keywords))
    if any("served" in i.fixturenames for i in items):
        SESSION_SERVER.private()
        start_session_server()
    if any("preflight_night" in i.fixturenames for i in items) and not _slurm_running():
        start_night()
    need_gpu = [i for i in items if "gpu" in i.keywords]
    need_slurm = [i for i in items if "slurm" in i.keywords]
    if need_gpu and not _cuda_available():
        skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
        for item in need_gpu:
            item.add_marker(skip)
    if need_slurm and (reason := _slurm_running()):
        if os.environ.get("REQUIRE_SLURM") == "1":  # CI starts Slurm; a skip there would hide a broken launcher
            raise pytest.UsageError(f"REQUIRE_SLURM=1 but {reason}")
        for item in need_slurm:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def isolated_environ(monkeypatch):
    """Bridge's runtime_config_update writes to os.environ; give each test its own copy."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def pytest_sessionfinish(session, exitstatus):
    if NIGHT.get("proc") is not None and NIGHT["proc"].poll() is None:
        NIGHT["proc"].kill()  # a session cut short (-x, Ctrl-C): its jobs end on their own, preflight-only
    shutil.rmtree(NIGHT["dir"], ignore_errors=True)
    paths = plan_server.Paths.of(environ=served_env())
    if plan_server.holder(paths) is not None:
        plan_server.stop(paths)
    shutil.rmtree(SESSION_SERVER.dir, ignore_errors=True)


def make_command(target: str, *variables: str) -> list[str]:
    """The Python command line `make <target> <variables>` runs, as the Makefile writes it (`make -n`): from `-m`."""
    out = subprocess.run(
        ["make", "-n", "-s", target, *variables], cwd=stack.REPO_ROOT, capture_output=True, text=True, check=True
    )
    argv = shlex.split(out.stdout.strip().splitlines()[-1])
    return argv[argv.index("-m") + 1 :]


@pytest.fixture
def make_here(capsys):
    """`make <target> <variables>` run in this process: the Makefile's own command line, the module's `main` (its
    work, its printing, its exit status; not make's plumbing or a new process: the tests that type make keep those).
    Returns (status, stdout, stderr)."""

    def run(target: str, *variables: str) -> tuple[int, str, str]:
        module, *argv = make_command(target, *variables)
        capsys.readouterr()
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as exc:  # argparse's bad-argument exit (launch.args.Parser): status 2, one line
            code = exc.code
        return (code, *capsys.readouterr())

    return run
