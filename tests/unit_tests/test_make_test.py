"""`make test` as a user types it (new processes, the Makefile's own line): a path in PYTEST_ARGS runs that path only;
no path runs pyproject's testpaths, the whole suite (tests/conftest.py judges the docs' targets only then). Both are
collections without the repo's conftest (no Bridge import): seconds."""

from __future__ import annotations

import os
import subprocess

from overlapkit import paths


def make_test(pytest_args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_ARGS")}  # this session's own
    cmd = ["make", "-s", "test", f"PYTEST_ARGS=--noconftest -p no:cacheprovider --collect-only {pytest_args}"]
    return subprocess.run(cmd, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_path_runs_that_path_only(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    out = make_test(f"-q {probe}")
    assert out.returncode == 0, out.stdout + out.stderr
    collected = [line.rsplit("/", 1)[-1] for line in out.stdout.splitlines() if "::" in line]  # ids from the rootdir
    assert collected == ["test_probe.py::test_one", "test_probe.py::test_two"], out.stdout


def test_no_path_runs_the_whole_suite():
    """The header names testpaths when pytest chose them; `-p no:python` keeps the collection itself empty."""
    out = make_test("-p no:python")
    assert "\ntestpaths: tests\n" in out.stdout, out.stdout + out.stderr
