"""Bad input as a user types it, through `make` in new processes: one line each, answered before the Bridge import,
and the exit status a script sees (make exits 2 on any failure, GNU make's own rule; its `Error N` line carries ours:
1 = audit errors, 2 = bad input; the command without make returns N itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import pytest

from launch import commands
from overlapkit import paths
from overlapkit.cluster.profiles import load_profile

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
Q30 = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"  # 128 experts, top-8
R405 = "llama31_405b_pretrain_1024gpu_h100_bf16"  # 128 nodes: more than the local Slurm's 8


def make(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=timeout)


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
    ("plan", "NODES=99999999999999999999", "8-GPU nodes from 1 to 16384"),
    ("plan", "NODES=８", "NODES='８': must be a whole number"),
    ("plan", "SET=optimizer.lr=1.0e+400", "optimizer.lr='1.0e+400': not a finite number"),
    ("plan", "SET=optimizer.lr=.nan", "optimizer.lr='.nan': not a finite number"),
    ("plan", "SET=optimizer.lr=-1.0", "optimizer.lr=-1.0: must be > 0 (the step size"),
    ("plan", "SET=train.global_batch_size=128 train.global_batch_size=256", "train.global_batch_size is set twice"),
    ("plan", "SET=model.foo.bar=1", "unknown key 'model.foo.bar'"),
    ("plan", "SET=model.seq_length=100000000000000000000", "beyond the 64-bit integers Megatron stores"),
    ("plan", "SET=train.train_iters=null", "one of train.train_iters, train.train_samples, train.num_epochs"),
    ("plan", "SET=model.hidden_size=4100", "hidden 4100 is not divisible by heads 32 (head dim)"),
    ("plan", (f"RECIPE={Q30}", "SET=model.num_moe_experts=null"), "this recipe is a mixture of 128 experts"),
    ("plan", (f"RECIPE={Q30}", "SET=model.moe_router_topk=200"), "model.moe_router_topk=200: more than the 128"),
    ("plan", (f"RECIPE={Q30}", "SET=model.moe_router_topk=0"), "model.moe_router_topk=0: must be a whole number ≥ 1"),
    ("plan", (f"RECIPE={Q30}", "SET=model.moe_router_topk=-1"), "model.moe_router_topk=-1: must be a whole number"),
    ("submit", (f"RECIPE={R405}", "CLUSTER=local"), "128 nodes requested but partition"),
    ("plan", "GPU=b200", "GPU=b200: not a GPU the models know; use one of h100, h200"),
    ("recipes", "GPU=h300", "GPU=h300: not a GPU"),
    ("sbatch", "GPU=a100", "GPU=a100: not a GPU"),
    ("new-recipe", "GPU=b200", "GPU=b200: not a GPU"),
]


# Typed through make in a new process: one case per target (make's `Error 2` line, the time before any import).
THROUGH_MAKE = {"plan-NODES=0", "submit-CLUSTER=nosuch", "sbatch-NODES=-1", "plan-GPU=b200"}
IDS = [f"{t}-{a if isinstance(a, str) else ' '.join(a)}" for t, a, _ in BAD]
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
    assert time.monotonic() - t0 < 20  # before the Bridge import (measured facts: ~30 s)


@pytest.mark.parametrize(
    ("target", "arg", "needle"), [b for b, i in zip(BAD, IDS, strict=True) if i not in THROUGH_MAKE]
)
def test_bad_input_is_one_line_with_exit_2(make_here, target, arg, needle):
    args = [arg] if isinstance(arg, str) else list(arg)
    before = written()
    code, out, err = make_here(target, *([f"RECIPE={R8}"] if not any("RECIPE=" in a for a in args) else []), *args)
    assert code == 2 and out == "" and one_line(err) == [next(x for x in one_line(err) if needle in x)], err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert written() == before  # no run directory left behind


def written() -> set:
    """What a plan or a submission writes: run directories (runs/, the local profile's job_dir)."""
    roots = [paths.runs_root(), load_profile("local").job_path / "runs"]
    return {p for r in roots if r.is_dir() for p in r.iterdir()}


@pytest.mark.parametrize("entry", ["plan", "submit"])
def test_a_value_that_starts_with_a_dash_reaches_our_own_check(entry, capsys):
    """`NSYS=-1:5` passed as one argument (`--nsys=-1:5`: argparse takes a separate `-1:5` for an option)."""
    argv = [R8, "--nsys=-1:5"] if entry == "plan" else [f"--recipe={R8}", "--nsys=-1:5"]
    assert commands.call(entry, argv) == 2
    err = capsys.readouterr().err
    assert err == "error: NSYS='-1:5': use <start>:<end> iterations with start < end, e.g. NSYS=10:12\n"


def test_audit_errors_and_bad_input_differ_for_a_script():
    audit = make("plan", "RECIPE=llama3_70b_pretrain_64gpu_h100_bf16", "SET=comm_overlap.overlap_grad_reduce=false")
    assert audit.returncode == 2 and "Error 1" in audit.stderr  # make's exit is 2; its line says ours was 1
    direct = subprocess.run(
        [sys.executable, "-m", "launch", "plan", R8, "--nodes", "0"],
        cwd=paths.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": "src:."},
    )
    assert direct.returncode == 2 and direct.stderr.startswith("error: NODES='0'")


def test_a_plan_that_does_not_fit_the_gpu_never_ends_audit_ok(make_here):
    code, out, err = make_here("plan", f"RECIPE={R8}", "SET=model.seq_length=1048576 dataset.seq_length=1048576")
    assert code == 1 and "does NOT fit" in out and "audit: OK" not in out and "audit: 1 error(s)" in out
    assert err.startswith("error: [memory_does_not_fit] memory (first pipeline stage, per GPU)"), err


# Answered before the Bridge import (in a process that never imports torch): what the in-process cases above cannot
# show, since this test process has Bridge loaded. One new process for all of them.
EARLY = [
    ("plan", [R8, "--set", "train.global_batch_size=0"], "must be a whole number ≥ 1"),  # a key SET types early
    ("plan", [R8, "--set", "optimizer.lr=1.0e+400"], "not a finite number"),
    ("plan", [R8, "--nsys", "1:99999999999999999999"], "iterations are at most"),
    ("submit", ["--recipe", R405, "--cluster", "local"], "128 nodes requested but partition"),
    ("new-recipe", ["--from", R8, "--name", "advfw_pretrain_８gpu_h100_bf16"], "must be <model>_pretrain_"),
    ("new-recipe", ["--from", "nosuch", "--name", "x_pretrain_8gpu_h100_bf16"], "FROM=nosuch: unknown recipe"),
    ("new-recipe", ["--from", R8, "--name", R405], f"recipe {R405} is already registered"),
]


def test_bad_names_keys_and_node_counts_are_answered_before_the_import():
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from launch import commands
        out = []
        for name, argv, _ in {EARLY!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                out.append([commands.main([name, *argv]), err.getvalue()])
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "megatron", "nemo_run"}})
        print(json.dumps({{"results": out, "loaded": loaded}}))
    """)
    env = {"PYTHONPATH": "src:.", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=paths.REPO_ROOT, env=env)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["loaded"] == []
    for (_, argv, needle), (status, err) in zip(EARLY, got["results"], strict=True):
        assert status == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, (argv, err)
