"""Shared test set-up: Bridge is imported once per pytest process (≈30 s on CPU), offline, with the TE shim."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from overlapkit import stack

# Every `make plan` a test runs plans in its own process, as CI and jobs do, and no test leaves a plan server behind;
# tests/e2e/test_plan_server_e2e.py runs one in a private directory and stops it (launch/plan_server.py).
os.environ["OVERLAPKIT_PLAN_SERVER"] = "0"
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


@pytest.fixture
def isolated_environ(monkeypatch):
    """Bridge's runtime_config_update writes to os.environ; give each test its own copy."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)
