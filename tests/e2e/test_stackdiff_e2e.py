"""`make stack-diff` as a user types it, offline: the candidate is the pinned stack itself (built by uv from the cache
`make setup` filled, OVERLAPKIT_STACK_OFFLINE=1), so every recipe it plans is unchanged and the exit status is 0; a
malformed STACK or a stack that does not install is one line and exit 2. No network: uv runs with --offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import stack_diff
from overlapkit import paths
from overlapkit.bridge import stackenv

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def _env(tmp_path) -> dict:
    return {**os.environ, stackenv.STACKS_VAR: str(tmp_path / "stacks"), stack_diff.OFFLINE_VAR: "1"}


def test_the_pinned_stack_against_itself_is_unchanged_and_exits_0(pinned_stack_diff):
    out, stacks = pinned_stack_diff  # typed at collection (tests/conftest.py EARLY): its minute overlaps other tests
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [(r["recipe"], r["verdict"]) for r in d["recipes"]] == [(R8, "unchanged")]
    assert d["pinned"] == d["candidate"] and d["packages"] == []
    assert d["environment"]["built"] and str(stacks) in d["environment"]["path"]
    assert "building the candidate stack" in out.stderr  # said once, before the minutes it takes


def test_a_malformed_stack_is_one_line_and_exit_2_before_anything_is_built(tmp_path):
    out = subprocess.run(
        ["make", "-s", "stack-diff", "STACK=megatron-bridge>=0.6"],
        cwd=paths.REPO_ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines()[0] == (
        "error: STACK: 'megatron-bridge>=0.6' is not name==version (exact pins only, e.g. megatron-core==0.19.0)"
    )
    assert not (tmp_path / "stacks").exists()


def test_a_stack_that_does_not_install_is_one_line_from_uv_and_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "launch", "stack-diff", "--stack=megatron-core==99.0.0", f"--recipes={R8}"]
    out = subprocess.run(cmd, cwd=paths.REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: stack megatron-core==99.0.0 does not install: uv: ")
