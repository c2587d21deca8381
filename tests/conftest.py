"""Shared test set-up: Bridge is imported once per pytest worker (≈30 s on CPU), offline, with the TE shim.

The suite runs in two pytest-xdist workers (pyproject's addopts: `-n 2`), one per CPU here, handed out by group
(pytest_xdist_make_scheduler below): the Slurm tests are one group, run in turn on one worker (their jobs share the
one local Slurm, and each waits for the night below), while the other worker runs the rest, module by module (a
module's fixtures are made once). What the session does once for all its workers (EARLY's commands, the docs' judge)
goes through SHARED, a folder the first process makes. `make test PYTEST_ARGS="-n 0"` runs it all in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import make_targets
import pytest

from launch import commands, stack_diff
from overlapkit import paths
from overlapkit.bridge import stack, stackenv
from overlapkit.cluster import plan_server

sys.addaudithook(make_targets.record)  # every make a test starts, recorded: the docs' rule is judged on them

# Every make a test runs is a make as a user types it, at the top level. Under `make test` the outer make's
# MAKEFLAGS/MAKELEVEL reach pytest, and each make a test starts would be a sub-make: "Entering directory" lines on
# the stdout a test parses (make -w is on below the top level), and `make test X=1`'s command-line variables as
# overrides inside every target under test.
for _var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(_var, None)

# "gw0", "gw1", ... in an xdist worker; "" in the process that starts them, or in a run of one process (-n 0)
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# The session's folder for what its workers share, made by the first process (its workers inherit the variable)
SHARED_VAR = "OVERLAPKIT_TEST_SESSION"
if not WORKER:
    os.environ[SHARED_VAR] = tempfile.mkdtemp(prefix="oksession-", dir="/tmp")
SHARED = Path(os.environ[SHARED_VAR])
make_targets.LEDGER = SHARED / "ran"

# No test uses your plan server, and none leaves one behind: every process a test starts finds its server, if any,
# in this session's own directory (started by the first command that needs Bridge, as yours is; stopped at the end).
# Whether there is one is decided as for you: OVERLAPKIT_PLAN_SERVER=0|1, else the profile's plan_server (local:
# on). The suite passes either way: `OVERLAPKIT_PLAN_SERVER=0 make test` runs every command in its own process.
SERVER_DIR = tempfile.mkdtemp(prefix="okps-", dir="/tmp")  # short: a socket path has 107 bytes at most
os.environ[plan_server.DIR_VAR] = SERVER_DIR
# What the suite's commands write for a user (run directories, the local profile's runs/slurm jobs, calibrations,
# nemo_run's home) goes to this session's own folder, never the checkout's runs/, where your next `make status` or
# `make calibrate` would find it (paths.RUNS_VAR, the product's one setting for it). In /tmp: the local Slurm's jobs
# read and write it too. Named runs/, as the checkout's is.
RUNS_DIR = Path(tempfile.mkdtemp(prefix="okruns-", dir="/tmp")) / "runs"
os.environ[paths.RUNS_VAR] = str(RUNS_DIR)
# Bytecode, cached once for the session's processes. Under PYTHONDONTWRITEBYTECODE=1 (this machine's shells, CI's)
# every new Python compiles torch, Bridge and what they import from source: half of a Bridge import's CPU (~20 s of
# 40), paid again by each make, plan server and planner a test starts. Here they share one cache in /tmp
# (PYTHONPYCACHEPREFIX: nothing is written in the checkout or .venv), filled by the first Bridge import; a shell
# that writes bytecode already keeps its own. The product is untouched; Slurm's jobs get PATH only, as a user's do.
# Made before the workers start, which inherit it.
PYCACHE_DIR = None
if sys.dont_write_bytecode:
    PYCACHE_DIR = sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="okpyc-", dir="/tmp")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def _starts_workers(config) -> bool:
    """This process hands the tests to xdist workers and runs none itself."""
    return not WORKER and config.getoption("dist", "no") != "no"


def pytest_configure(config):
    """Bridge imported where tests run. The process that only hands out tests never needs it: where it hands out the
    whole suite, it types EARLY's commands at once, while its workers import Bridge (the night's tests wait for the
    night, whose start then comes about 40 s sooner); else each is typed by a worker that collects a test of it."""
    if not _starts_workers(config):
        stack.import_bridge()
    elif collected(config) == make_targets.SUITE:
        for name in EARLY if _slurm_running() is None else ("pinned_stack_diff",):
            _start(name)
        make_targets.ended("")  # the makes it typed, for the judge


def collected(config) -> list[str]:
    """The paths pytest collects, resolved (the arguments, else pyproject's testpaths)."""
    return [str(Path(a.split("::")[0]).resolve()) for a in config.args]


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
    from overlapkit.bridge.build import make_plan

    cache = {}

    def get(name: str):
        if name not in cache:
            before = dict(os.environ)
            cache[name] = make_plan(name, caller_env={})
            assert dict(os.environ) == before, f"planning {name} wrote the environment"
        return cache[name]

    return get


def group_of(item) -> str:
    """A test's group, which one worker runs whole, handed out in the order its first test comes: the Slurm tests
    one group, the docs' judge one of its own, every other test its module's."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    return "judge" if item.name == make_targets.JUDGE else item.nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope, the scopes our groups (the workers write them at collection). Not --dist
    loadgroup: pytest-xdist 3.8 marks a group in `item._nodeid`, which pytest 9 no longer reads for the id."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            if not self.groups:
                self.groups.update(json.loads((SHARED / "groups.json").read_text()))
            return self.groups[nodeid]

    return ByGroup(config, log)


@pytest.hookimpl(trylast=True)  # after any shuffle (--random-order): the docs' judge is put last below
def pytest_collection_modifyitems(config, items):
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
    make_targets.WHOLE["args"] = collected(config)
    # A Slurm test waits for the night (started at collection, slurm_after_the_night) while the rest uses the CPU.
    # In workers, the Slurm group first: its worker waits while the other works, in any order. In one process, the
    # Slurm tests last, unless shuffled. Only the time changes: any order passes.
    if WORKER:
        items.sort(key=lambda i: "slurm" not in i.keywords)
    elif not _shuffled(config):
        items.sort(key=lambda i: "slurm" in i.keywords)
    items.sort(key=lambda item: item.name == make_targets.JUDGE)  # stable: every other test keeps its order


def _shuffled(config) -> bool:
    """--random-order (or its bucket or seed) given: its order is the one to keep (pytest-random-order's own test of
    whether it is on)."""
    try:
        from random_order.config import Config
    except ImportError:
        return False
    return Config(config).is_enabled


def pytest_deselected(items):
    make_targets.WHOLE["partial"].append(f"{len(items)} tests deselected")


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" not in report.keywords:
        make_targets.WHOLE["partial"].append(f"{report.nodeid} skipped")
    if report.when == "teardown":  # (run after a failed or skipped setup too)
        make_targets.ended(report.nodeid)  # that it ended, and what this worker ran: for the judge, in any worker


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
    """What this session started early (EARLY), ended if no test can wait for it any more (a worker's waits for the
    other workers' tests); the plan server it started, stopped; the first process's folders, removed."""
    for started in STARTED.values():
        if started["proc"].poll() is None and (WORKER and not session.shouldstop):
            started["proc"].wait(timeout=1800)  # another worker's test may read it yet
        if started["proc"].poll() is None:  # the session ended before a test waited for it
            os.killpg(started["proc"].pid, signal.SIGTERM)
            started["proc"].wait(timeout=120)
        started["thread"].join(timeout=60)
    _, lock, _ = plan_server.paths()
    if pid := plan_server.holder(lock):  # 0: one is starting, its pid not yet written
        os.kill(pid, signal.SIGTERM)
    shutil.rmtree(SERVER_DIR, ignore_errors=True)
    shutil.rmtree(RUNS_DIR.parent, ignore_errors=True)
    if WORKER:
        return
    for pgid in SHARED.glob("*/pgid"):  # a worker that died left its early command running
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pgid.read_text()), signal.SIGTERM)
    shutil.rmtree(SHARED, ignore_errors=True)
    if PYCACHE_DIR:
        sys.dont_write_bytecode = True  # this process's last imports (the summary's) would make it anew
        shutil.rmtree(PYCACHE_DIR, ignore_errors=True)


# Stands in for the Makefile's PY (uv's python): prints the arguments make's shell gave it, one JSON line.
ARGV_PROBE = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"


def make_command(target: str, *variables: str) -> list[str]:
    """The Python command line `make <target> <variables>` runs, from `-m`: make runs its own recipe line, variables
    exported and named by its shell as the Makefile does it, with PY= a probe that prints the arguments it got."""
    out = subprocess.run(
        ["make", "-s", target, *variables, f"PY={ARGV_PROBE}"],
        cwd=paths.REPO_ROOT,
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
    """`make <target> <variables>` run in this process: the Makefile's own command line through the dispatcher
    (launch/commands.py: its checks, its work, its printing, its exit status; not make's plumbing, a new process or
    a server: the tests that type make keep those). Returns (status, stdout, stderr)."""

    def run(target: str, *variables: str) -> tuple[int, str, str]:
        module, *argv = make_command(target, *variables)
        capsys.readouterr()
        assert module == "launch", f"make {target} runs {module}, not a row of launch/commands.py"
        try:
            code = commands.call(argv[0], argv[1:])
        except SystemExit as exc:  # argparse's bad-argument exit (launch.args.Parser): status 2, one line
            code = exc.code
        return (code, *capsys.readouterr())

    return run


# Commands typed once a session, as soon as it knows it runs a test that reads them (pytest_collection_finish), so
# that they run while the tests before them do: a fixture's name → the make target and variables, in a folder of
# the session's own (`d`, in SHARED: the first worker to collect types it, any worker's test reads it), with the
# environment variables it adds.
# The night: Slurm runs its jobs meanwhile. The pinned stack against itself: about a minute of uv and two Bridge
# imports (the candidate's compiled from source), niced so that it takes what the tests before it leave.
EARLY = {
    "preflight_night": (
        lambda d: ["nightly", "CLUSTER=local", "PREFLIGHT=1", f"JOB_DIR={d / 'jobs'}"],
        lambda d: {},
        0,
    ),
    "pinned_stack_diff": (
        lambda d: ["stack-diff", f"STACK={_pinned()}", "RECIPES=llama3_8b_pretrain_8gpu_h100_bf16", "FORMAT=json"],
        lambda d: {stackenv.STACKS_VAR: str(d / "stacks"), stack_diff.OFFLINE_VAR: "1"},
        10,
    ),
}
STARTED: dict[str, dict] = {}  # fixture name → {"proc", "thread"}: those this process typed


def _pinned() -> str:
    """uv.lock's Bridge and Core, as STACK= pins (read only when the stack-diff is typed)."""
    return " ".join(f"{n}=={stackenv.locked()[n]}" for n in ("megatron-bridge", "megatron-core"))


def _start(name: str) -> Path:
    """EARLY[name] typed, unless a process of this session did (the first to get here makes its folder): its folder,
    where `status` appears once make has returned."""
    d = SHARED / name
    try:
        d.mkdir()
    except FileExistsError:
        return d
    variables, env, nice = EARLY[name]
    with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
        proc = subprocess.Popen(
            ["make", "-s", *variables(d)],
            cwd=paths.REPO_ROOT,
            env={**os.environ, **env(d)},
            stdout=out,
            stderr=err,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
            start_new_session=True,  # one process group: given its priority back, or ended, as one
        )
    (d / "pgid").write_text(str(proc.pid))

    def wait() -> None:  # its status, for a test in any worker: written whole, then renamed
        (d / "status.part").write_text(str(proc.wait()))
        (d / "status.part").rename(d / "status")

    STARTED[name] = {"proc": proc, "thread": threading.Thread(target=wait, daemon=True)}
    STARTED[name]["thread"].start()
    return d


def early_result(name: str) -> tuple[subprocess.CompletedProcess, Path]:
    """(CompletedProcess, its folder) of EARLY[name] once make has returned (typed now if it was not)."""
    d = _start(name)
    args = ["make", "-s", *EARLY[name][0](d)]
    # A test waits for it now: niced no more (only root may raise a priority; a group already gone has none).
    with contextlib.suppress(PermissionError, ProcessLookupError, FileNotFoundError, ValueError):
        os.setpriority(os.PRIO_PGRP, int((d / "pgid").read_text()), 0)
    deadline = time.monotonic() + 1800
    while not (d / "status").exists():
        assert time.monotonic() < deadline, f"{shlex.join(args)} has not returned in 30 minutes"
        time.sleep(0.5)
    out, err = ((d / f).read_text() for f in ("stdout", "stderr"))
    return subprocess.CompletedProcess(args, int((d / "status").read_text()), out, err), d


@pytest.hookimpl(tryfirst=True)  # before the worker tells xdist what it collected
def pytest_collection_finish(session):
    groups = SHARED / f"groups.{os.getpid()}"
    groups.write_text(json.dumps({item.nodeid: group_of(item) for item in session.items}))
    groups.rename(SHARED / "groups.json")  # every worker's are the same
    if session.config.option.collectonly:
        return
    for name in EARLY:
        if any(name in i.fixturenames and not i.get_closest_marker("skip") for i in session.items):
            _start(name)


NIGHT_OVER = []  # [True] once this worker has seen the night's jobs end


@pytest.fixture(autouse=True)
def slurm_after_the_night(request):
    """A Slurm test starts once the night's jobs have ended, on the idle cluster it had when the night was typed in
    the test that reads it: its jobs would otherwise queue behind the night's (its timeouts, its squeue
    before/after)."""
    if request.node.get_closest_marker("slurm") and (SHARED / "preflight_night").exists() and not NIGHT_OVER:
        from overlapkit.cluster import slurm

        _, d = early_result("preflight_night")
        for record in (d / "jobs" / "nightly").glob("*/night.json"):
            ran = json.loads(record.read_text())
            for job in [e.get("job_id") for e in ran["entries"]] + [ran.get("report_job_id")]:
                if job:
                    slurm.wait_for(job, timeout=1800)
        NIGHT_OVER.append(True)


@pytest.fixture(scope="session")
def preflight_night():
    """`make nightly CLUSTER=local PREFLIGHT=1` typed once for the tests that read a night (the nightly e2e, the
    70B run of the Slurm e2e): (CompletedProcess, JOB_DIR) once make has returned. Its jobs may still run."""
    done, d = early_result("preflight_night")
    return done, d / "jobs"


@pytest.fixture(scope="session")
def pinned_stack_diff():
    """`make stack-diff STACK=<the pinned stack> RECIPES=<Llama3 8B> FORMAT=json`, offline, its candidate built in
    its own stacks folder: (CompletedProcess, that folder)."""
    done, d = early_result("pinned_stack_diff")
    return done, d / "stacks"
