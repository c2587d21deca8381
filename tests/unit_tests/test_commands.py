"""The command table and its dispatcher (launch/commands.py): every make target that runs Python is one row, and the
exit status comes from our own error classes only: bad input 2 (one line), an audit that fails 1, a cluster tool's
refusal 3 with the cluster's own message, and anything else a traceback, as a bug should look."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys

import pytest

from launch import commands
from overlapkit import paths
from overlapkit.bridge import build
from overlapkit.errors import AuditFailed, BadInput, ClusterFailure
from overlapkit.makewatch import Interrupted

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


TOOLS = {"test", "bench", "gpu-check", "docs"}  # pytest, bench/ and tools/ scripts: tools, not commands of the table


def test_every_make_target_is_one_row_and_every_row_a_command():
    makefile = (paths.REPO_ROOT / "Makefile").read_text()
    runs = dict(re.findall(r"^([a-z-]+):.*\n\t@?(.*\$\(PY\).*)$", makefile, re.MULTILINE))
    assert {t for t, line in runs.items() if not line.startswith("$(PY) -m launch ")} == TOOLS
    called = re.findall(r"\$\(PY\) -m launch ([a-z-]+)", makefile)
    assert "-m launch." not in makefile  # no target runs a module of launch/ by itself
    assert set(called) <= set(commands.COMMANDS)
    unreached = set(commands.COMMANDS) - set(called)
    # What the scheduler job runs (overlapkit/nightly/schedule.py), and the server a client starts (plan_server.py).
    assert unreached == {"nightly-schedule-run", "plan-server"}
    for name, cmd in commands.COMMANDS.items():
        module = __import__(cmd.module, fromlist=["run"])
        assert all(callable(getattr(module, f, None)) for f in ("parse", "check", "run")), name


def test_an_unknown_command_is_one_line(capsys):
    assert commands.main(["plna"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'plna': one of recipes, plan,")


def test_an_internal_error_in_a_run_is_a_traceback_not_bad_input(monkeypatch):
    """A KeyError inside the plan (a bug, not the user's input) is never answered as bad input: it propagates."""

    def broken(*_args, **_kwargs):
        raise KeyError("tp")

    monkeypatch.setattr(build, "plan_for", broken)
    with pytest.raises(KeyError, match="tp"):
        commands.call("plan", [R8, "--format", "json"])


def test_an_internal_error_before_the_import_shows_its_traceback_and_exits_1():
    """As a user's process meets it: a bug in a check (here a KeyError planted in NODES= parsing) prints Python's
    traceback and exits 1, not one line and 2."""
    code = (
        "import sys\n"
        "from overlapkit.bridge import inputs\n"
        "def broken(*a, **k):\n"
        "    raise KeyError('nodes')\n"
        "inputs.parse_nodes = broken\n"
        "from launch import commands\n"
        f"sys.exit(commands.main(['plan', {R8!r}, '--nodes', '2']))\n"
    )
    env = {"PYTHONPATH": "src:.", "PATH": "/usr/bin:/bin", "OVERLAPKIT_PLAN_SERVER": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "Traceback (most recent call last)" in out.stderr and out.stderr.rstrip().endswith("KeyError: 'nodes'")


def test_a_refused_sbatch_shows_the_clusters_message_and_exits_3(tmp_path, monkeypatch, capsys):
    """Stand-ins for Slurm's tools on PATH (sbatch refuses as Slurm words it; sinfo and squeue answer as the local
    Slurm does): make nightly-schedule's sbatch is refused, and the user reads sbatch's own line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    refusal = "sbatch: error: Batch job submission failed: Invalid qos specification"
    for tool, body in {
        "sbatch": f"echo '{refusal}' >&2; exit 1",
        "sinfo": "echo '8|gpu:8|1-00:00:00'",
        "squeue": "exit 0",
    }.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    code = commands.call("nightly-schedule", ["--cluster", "local", "--at", "now+90", "--job-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.startswith("error: ") and refusal in err and err.count("\n") == 1


def test_every_error_class_of_ours_is_bad_input_an_audit_or_the_clusters():
    """The dispatcher catches these three (and a signal's Interrupted) and nothing wider: a class of ours outside
    them would reach the user as a traceback."""
    ours = {BadInput, AuditFailed, ClusterFailure, Interrupted}
    found = []
    src = paths.REPO_ROOT / "src"
    for path in sorted((src / "overlapkit").rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found.append(cls)
                assert issubclass(cls, tuple(ours)), f"{name}.{cls.__name__} is none of ours"
    assert len(found) > 15  # the walk reached the library's classes (ForkError, FileProblem, LiveRun, ...)
