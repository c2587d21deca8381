"""Bad input as a user types it, through `make` in new processes: one line each, answered before the Bridge import,
and the exit status a script sees (make exits 2 on any failure, GNU make's own rule; its `Error N` line carries ours:
1 = audit errors, 2 = bad input; the command without make returns N itself)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from overlapkit import stack

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def make(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=stack.REPO_ROOT, capture_output=True, text=True, timeout=timeout)


BAD = [
    ("plan", "NODES=0", "NODES='0': must be a whole number"),
    ("plan", "NODES=two", "NODES='two'"),
    ("plan", "SET=train.global_batch_size=0", "train.global_batch_size=0: must be a whole number ≥ 1"),
    ("plan", "SET=model.tensor_model_parallel_size=-1", "must be a whole number ≥ 1"),
    ("plan", "SET=train.micro_batch_size=1.5", "expected an integer"),
    ("plan", "SET=train.global_batch_sise=8", "did you mean train.global_batch_size?"),
    ("plan", "RECIPE=llama3_8b_pretrain_8gpu_h100_bf61", "unknown recipe"),
    ("submit", "SET=model.seq_length=0", "model.seq_length=0"),
    ("submit", "CLUSTER=nosuch", "unknown cluster profile 'nosuch'"),
    ("submit", "PREFLIGHT=maybe", "PREFLIGHT='maybe'"),
    ("sbatch", "NODES=-1", "NODES='-1'"),
    ("plan", "GPU=b200", "GPU=b200: not a GPU the models know; use one of h100, h200"),
    ("recipes", "GPU=h300", "GPU=h300: not a GPU"),
    ("sbatch", "GPU=a100", "GPU=a100: not a GPU"),
    ("new-recipe", "GPU=b200", "GPU=b200: not a GPU"),
]


# Typed through make in a new process: one case per target (make's `Error 2` line, the time before any import).
THROUGH_MAKE = {"plan-NODES=0", "submit-CLUSTER=nosuch", "sbatch-NODES=-1", "plan-GPU=b200"}
IDS = [f"{t}-{a}" for t, a, _ in BAD]
assert THROUGH_MAKE <= set(IDS), THROUGH_MAKE - set(IDS)  # a misspelt id would move no case


def one_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]


@pytest.mark.parametrize(("target", "arg", "needle"), [b for b, i in zip(BAD, IDS, strict=True) if i in THROUGH_MAKE])
def test_bad_input_through_make_is_one_line_before_the_import(target, arg, needle):
    t0 = time.monotonic()
    out = make(target, *([f"RECIPE={R8}"] if "RECIPE=" not in arg else []), arg, timeout=30)
    ours = one_line(out.stderr)
    assert out.returncode == 2 and ours == [next(x for x in ours if needle in x)], out.stderr
    assert ours[0].startswith("error: ") and "Error 2" in out.stderr  # make's line carries our status
    assert time.monotonic() - t0 < 20  # before the Bridge import (about 50 s here)


@pytest.mark.parametrize(
    ("target", "arg", "needle"), [b for b, i in zip(BAD, IDS, strict=True) if i not in THROUGH_MAKE]
)
def test_bad_input_is_one_line_with_exit_2(make_here, target, arg, needle):
    code, out, err = make_here(target, *([f"RECIPE={R8}"] if "RECIPE=" not in arg else []), arg)
    assert code == 2 and out == "" and one_line(err) == [next(x for x in one_line(err) if needle in x)], err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_audit_errors_and_bad_input_differ_for_a_script():
    audit = make("plan", "RECIPE=llama3_70b_pretrain_64gpu_h100_bf16", "SET=comm_overlap.overlap_grad_reduce=false")
    assert audit.returncode == 2 and "Error 1" in audit.stderr  # make's exit is 2; its line says ours was 1
    direct = subprocess.run(
        [sys.executable, "-m", "launch.plan", R8, "--nodes", "0"],
        cwd=stack.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": "src:."},
    )
    assert direct.returncode == 2 and direct.stderr.startswith("error: NODES='0'")
