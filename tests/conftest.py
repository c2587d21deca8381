"""Shared test set-up: Bridge is imported once per pytest process (≈30 s on CPU), offline, with the TE shim."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from overlapkit import stack
from overlapkit.serve import client as serve_client
from overlapkit.serve import paths as serve_paths

# Every make a test runs is a make as a user types it, at the top level. Under `make test` the outer make's
# MAKEFLAGS/MAKELEVEL reach pytest, and each make a test starts would be a sub-make: "Entering directory" lines on
# the stdout a test parses (make -w is on below the top level), and `make test X=1`'s command-line variables as
# overrides inside every target under test.
for _var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(_var, None)

# No test leaves a plan server behind, and none uses yours: a process a test starts plans by itself unless the test
# asks for the session's server (the `served` fixture: one server in a private directory, started as soon as the
# collection shows a test that needs it, stopped at the end; src/overlapkit/serve/).
os.environ[serve_paths.SWITCH] = "0"
stack.import_bridge()


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


@pytest.fixture(scope="session")
def planned():
    """`planned(name)`: recipe `name` as shipped, planned once per session (make_plan with no overrides and no shell
    exports) and shared by the recipe, memory, MoE and run-plugin tests. Planning must not write the environment
    (a pure builder): checked on the one plan each recipe gets."""
    from overlapkit.plan.build import make_plan

    cache = {}

    def get(name: str):
        if name not in cache:
            before = dict(os.environ)
            cache[name] = make_plan(name, caller_env={})
            assert dict(os.environ) == before, f"planning {name} wrote the environment"
        return cache[name]

    return get


# The session's server is born as a user's is: a cold plan (the command `make plan` runs) pays the import and
# becomes the server, and a second plan typed at once after it is served (overlapkit/serve/client.py:
# become_server). Then, where a test reads it, the night every such test shares (the nightly e2e, the 70B run of
# the Slurm e2e): `make nightly CLUSTER=local PREFLIGHT=1` typed once, served. All of it in the background from the
# collection on, on the second core. One directory holds it all: short (a socket path has 107 bytes at most), in
# /tmp (every fake node sees it), the server's socket in server/.
SESSION = {"dir": Path(tempfile.mkdtemp(prefix="okpn-", dir="/tmp"))}


def served_env() -> dict:
    """The environment of a process that uses the session's plan server."""
    env = {**os.environ, serve_paths.DIR_VAR: str(SESSION["dir"] / "server")}
    env.pop(serve_paths.SWITCH, None)
    return env


R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
STEP = 't0=$EPOCHREALTIME; {cmd} >{d}/{name}.out 2>{d}/{name}.err; echo "$? $t0 $EPOCHREALTIME" >{d}/{name}.time\n'


def start_session(night: bool) -> None:
    d = SESSION["dir"]
    serve_paths.Paths.of(environ=served_env()).private()
    plan = f"{shlex.quote(sys.executable)} -m launch.plan {R8} --format json --runs {d / 'runs'}"
    script = STEP.format(cmd=plan, d=d, name="first") + STEP.format(cmd=plan, d=d, name="second")
    if night:
        night_cmd = ["make", "nightly", "CLUSTER=local", "PREFLIGHT=1", f"JOB_DIR={d / 'jobs'}"]
        script += STEP.format(cmd=shlex.join(night_cmd), d=d, name="night")
    SESSION["proc"] = subprocess.Popen(
        ["bash", "-c", script], cwd=stack.REPO_ROOT, env=served_env(), stdin=subprocess.DEVNULL, start_new_session=True
    )


def session_step(name: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    """A step of the session once it has ended: its (CompletedProcess, wall seconds)."""
    d, deadline = SESSION["dir"], time.monotonic() + timeout
    while not (d / f"{name}.time").is_file() and SESSION["proc"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if not (d / f"{name}.time").is_file():
        pytest.fail(f"the session's {name} step did not end in {timeout:.0f} s (tests/conftest.py: start_session)")
    rc, t0, t1 = (d / f"{name}.time").read_text().split()
    out, err = ((d / f"{name}.{k}").read_text() for k in ("out", "err"))
    return subprocess.CompletedProcess(name, int(rc), out, err), float(t1) - float(t0)


@pytest.fixture(scope="session")
def served():
    """The session's plan server, ready: the environment for processes that should use it. One Bridge import serves
    every `make` the e2e tests type and the unit tests' new processes."""
    if "proc" not in SESSION:
        start_session(night=False)
    paths = serve_paths.Paths.of(environ=served_env())
    assert serve_client.wait_ready(paths, timeout=900) is not None, (SESSION["dir"] / "first.err").read_text()[-3000:]
    return served_env()


@pytest.fixture(scope="session")
def served_alone(served):
    """The session's server once the session's own commands (its first plans, the night's `make nightly`) are done:
    for tests that count what it served."""
    SESSION["proc"].wait(timeout=900)
    return served


@pytest.fixture(scope="session")
def first_plans(served):
    """The session's cold `make plan` and the one typed at once after it: [(CompletedProcess, seconds)] × 2."""
    return [session_step("first"), session_step("second")]


@pytest.fixture(scope="session")
def preflight_night(served):
    """The shared night once `make nightly` has returned: (CompletedProcess, JOB_DIR). Its jobs may still run."""
    return session_step("night")[0], SESSION["dir"] / "jobs"


def pytest_collection_modifyitems(config, items):
    # Unit tests first, the e2e tests after them, and the tests that stop the session's server last: what the e2e
    # tests start early (the server, the nightly) runs on the second core while the unit tests run on the first.
    items.sort(key=lambda i: ("/e2e/" in str(i.path), "stops_server" in i.keywords))
    if any("served" in i.fixturenames for i in items):
        start_session(night=any("preflight_night" in i.fixturenames for i in items) and not _slurm_running())
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


@pytest.fixture(autouse=True)
def isolated_environ():
    """Every test gets its own copy of the environment: Bridge's code writes to os.environ (NVTE_* among others),
    and a variable left behind would reach every later new process, where the plan server's stamp reads it as
    another shell and restarts (and a plain-path comparison would print it as a shell export)."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def pytest_sessionfinish(session, exitstatus):
    if SESSION.get("proc") is not None and SESSION["proc"].poll() is None:
        os.killpg(SESSION["proc"].pid, 9)  # a session cut short (-x, Ctrl-C): its jobs end on their own
    paths = serve_paths.Paths.of(environ=served_env())
    if serve_paths.holder(paths) is not None:
        serve_client.stop(paths)
    shutil.rmtree(SESSION["dir"], ignore_errors=True)


# Stands in for the Makefile's PY (uv's python): prints the arguments make's shell gave it, one JSON line.
ARGV_PROBE = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"


def make_command(target: str, *variables: str) -> list[str]:
    """The Python command line `make <target> <variables>` runs, from `-m`: make runs its own recipe line, variables
    exported and named by its shell as the Makefile does it, with PY= a probe that prints the arguments it got."""
    out = subprocess.run(
        ["make", "-s", target, *variables, f"PY={ARGV_PROBE}"],
        cwd=stack.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    argv = json.loads(out.stdout.strip().splitlines()[-1])
    return argv[argv.index("-m") + 1 :]


@pytest.fixture
def make_argv():
    """`make_argv(target, *variables)`: [module, *argv] as `make <target> <variables>` runs it (make_command)."""
    return make_command


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
