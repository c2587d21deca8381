"""The first command in a checkout (tools/uv.sh, which every make target runs): with no .venv yet it says what it
installs and about how big, then lets uv sync with its own progress before the quiet `uv run`; with a .venv it says
nothing and runs the command alone. A stand-in `uv` on PATH records how it is called (no install happens here)."""

from __future__ import annotations

import os
import subprocess
import sys

from overlapkit import paths

UV_SH = paths.REPO_ROOT / "tools" / "uv.sh"


def _uv_sh(tmp_path, venv, *argv):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "uv"
    fake.write_text(f'#!/bin/sh\necho "uv $*" >> "{tmp_path}/calls"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "UV_PYTHON": sys.executable}
    env["UV_PROJECT_ENVIRONMENT"] = str(venv)
    out = subprocess.run(["bash", str(UV_SH), *argv], env=env, capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return out, calls


def test_the_first_run_says_what_it_installs_and_lets_uv_show_its_progress(tmp_path):
    out, calls = _uv_sh(tmp_path, tmp_path / "no-venv", "run", "--frozen", "--quiet", "python", "-c", "pass")
    assert out.returncode == 0, out.stderr
    notice = [line for line in out.stderr.splitlines() if line.startswith("first run: installing")]
    assert len(notice) == 1 and "torch" in notice[0] and " GB " in notice[0], out.stderr
    assert calls == ["uv sync --frozen", "uv run --frozen --quiet python -c pass"]  # the sync is not --quiet


def test_make_setup_on_a_first_run_says_so_and_syncs_once(tmp_path):
    out, calls = _uv_sh(tmp_path, tmp_path / "no-venv", "sync", "--frozen")
    assert "first run: installing" in out.stderr and calls == ["uv sync --frozen"]


def test_a_checkout_with_its_venv_runs_the_command_alone(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    out, calls = _uv_sh(tmp_path, venv, "run", "--frozen", "--quiet", "python", "-c", "pass")
    assert out.stderr == "" and calls == ["uv run --frozen --quiet python -c pass"]
