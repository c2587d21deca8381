"""Make variables are data (the Makefile's DATA_VARS, launch/args.py): whatever a variable holds (a quote and `;`,
make's `$(shell ...)`, a newline, `$HOME`, `--help`) reaches our own checks as typed, through `make` in new
processes as a user types it: nothing it names is run, and the answer is one line of ours."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from launch import new_recipe
from overlapkit import paths

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"

QUOTE = '"; touch {m}; echo "'  # closes a double-quoted shell word, runs a command, reopens the quote
MAKE_SHELL = "$(shell touch {m})"  # make's own function, run where make expands a reference
NEW = "llama3_34b_pretrain_32gpu_h100_bf16"

CASES = [  # (target, variables, what our one line starts with); {m} is the marker a run command would create
    ("plan", [f"RECIPE={R8}", "SET=train.global_batch_size=128" + QUOTE], "error: train.global_batch_size="),
    ("plan", [f"RECIPE={R8}", f"SET=train.global_batch_size={MAKE_SHELL}128"], "error: SET='train"),
    ("plan", [f"RECIPE={R8}" + QUOTE], "error: unknown recipe"),
    ("plan", [f"RECIPE={R8}", "NODES=1" + QUOTE], "error: NODES="),
    ("plan", [f"RECIPE={R8}", "GPU=h200" + QUOTE], "error: GPU="),
    ("recipes", [f"GPU={MAKE_SHELL}"], "error: GPU="),
    ("submit", [f"RECIPE={R8}", "RUN_NAME=a" + QUOTE], "error: RUN_NAME="),
    ("sbatch", [f"RECIPE={R8}", f"DATA={MAKE_SHELL}"], "error: DATA="),
    ("prep-data", ["IN=x" + QUOTE, "TOKENIZER=t", f"OUT={MAKE_SHELL}"], "error: OUT="),
    ("status", ["RUN=x" + QUOTE], "error: RUN="),
    ("parse-log", ["LOG=x" + QUOTE], "error: LOG="),
    ("nightly-schedule", ["AT=02:00" + QUOTE], "error: AT="),
    ("new-recipe", [f"NAME={NEW}", "ARGS=--tp 4; touch {m}"], "error: argument --tp: '4;'"),
    ("new-recipe", [f"NAME={NEW}", f"ARGS=--model {MAKE_SHELL}"], "error: MODEL="),
    ("gpu-check", ["CUTS=llama3_8b; touch {m}"], "error: CUTS="),
    ("calibrate", ["RUNS=x" + QUOTE], "error: RUNS: no directory"),
]


def make(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`make` as a user types it at the top level (tests/conftest.py drops the outer make's MAKEFLAGS)."""
    argv = ["make", *args]
    return subprocess.run(argv, cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def ours(stderr: str) -> list[str]:
    """stderr without make's own `make: *** [...] Error N` line."""
    return [line for line in stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]


def answered(out: subprocess.CompletedProcess, start: str) -> str:
    """The one line of ours a bad variable gets (exit 2, bad input), checked; returned for a closer look."""
    lines = ours(out.stderr)
    assert out.returncode == 2 and "Error 2" in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith(start), out.stderr
    assert "usage:" not in out.stdout + out.stderr and "Syntax error" not in out.stderr
    return lines[0]


@pytest.mark.parametrize(("target", "variables", "start"), CASES, ids=[f"{c[0]}-{c[1][-1][:24]}" for c in CASES])
def test_a_variable_never_runs_what_it_holds(tmp_path, target, variables, start):
    marker = tmp_path / "ran"
    t0 = time.monotonic()
    out = make(target, *(v.replace("{m}", str(marker)) for v in variables))
    answered(out, start)
    assert not marker.exists(), f"make {target} ran a command from a variable"
    assert time.monotonic() - t0 < 30  # answered before the Bridge import


@pytest.mark.parametrize("name", [f'{NEW}"', f"{NEW[:8]}\n{NEW[8:]}", f"x{QUOTE}"], ids=["quote", "newline", "shell"])
def test_a_quote_or_newline_in_name_gets_our_error(tmp_path, name):
    marker = tmp_path / "ran"
    out = make("new-recipe", f"NAME={name.replace('{m}', str(marker))}", f"ARGS=--recipes-dir {tmp_path}", timeout=300)
    line = answered(out, "error: recipe name ")
    assert repr(name.replace("{m}", str(marker))) in line  # the name as typed, one line (a newline shown as \n)
    assert not marker.exists() and not list(tmp_path.glob("*.py"))


def test_home_in_a_variable_is_refused_naming_the_fix():
    """`$HOME` reaches us as typed (make no longer eats `$H`): refused, with the double-quoted spelling that lets the
    shell expand it. The same for every variable (here SET and DATA, and OUT below the Bridge-free prep-data)."""
    line = answered(make("plan", f"RECIPE={R8}", "SET=checkpoint.save=$HOME/ckpt"), "error: SET=")
    assert "'$HOME' is passed as typed" in line and line.endswith('SET="checkpoint.save=$HOME/ckpt"')
    line = answered(make("plan", f"RECIPE={R8}", "DATA=${HOME}/data.toml"), "error: DATA=")
    assert line.endswith('DATA="${HOME}/data.toml"')
    answered(make("prep-data", "IN=a.jsonl", "TOKENIZER=t", "OUT=$HOME/tok"), "error: OUT='$HOME/tok'")


def test_a_value_is_never_an_option():
    out = make("parse-log", "LOG=--help")
    assert answered(out, "error: LOG=--help") and out.stdout == ""
    assert answered(make("plan", "RECIPE=--list"), "error: unknown recipe")  # not `make recipes`


def test_gpu_reaches_every_target_that_sizes_for_it_as_typed(make_argv):
    """GPU= is one of DATA_VARS: plan, recipes, submit, sbatch, run-local, new-recipe and overlap-report get it as one
    --gpu=value."""
    for target in ("plan", "recipes", "submit", "sbatch", "run-local", "new-recipe", "overlap-report"):
        _, _, *argv = make_argv(target, f"RECIPE={R8}", "GPU=h200 x")
        assert "--gpu=h200 x" in argv, (target, argv)


def test_args_is_split_as_a_shell_splits_words(make_argv):
    """ARGS= (the rest of make new-recipe's flags) is split by shlex, in Python: quotes group, nothing runs."""
    _, _, *argv = make_argv("new-recipe", f"NAME={NEW}", "LAYERS=48", "ARGS=--model 'Llama3 34B' --tp 4 --layers 40")
    args = new_recipe.parse(argv)
    assert (args.model, args.tp, args.layers, args.name) == ("Llama3 34B", 4, 40, NEW)  # a later flag wins
    line = answered(make("new-recipe", f"NAME={NEW}", "ARGS=--model 'Llama3"), "error: ARGS=")
    assert "no closing quotation" in line


# --- credentials (src/overlapkit/secrets.py: one rule for every way a value arrives) -----------------------------

HF = "hf_" + "Ab1" * 12  # made-up tokens of documented shapes
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
SLACK = "xoxb-1234567890-0987654321-AbCdEfGhIjKl"


def run_dirs() -> set:
    runs = paths.runs_root()
    return set(runs.iterdir()) if runs.is_dir() else set()


@pytest.mark.parametrize(
    ("variables", "start"),
    [
        ([f"SET=checkpoint.save={SLACK}"], "error: SET holds what looks like a Slack token"),
        ([f"RUN_NAME={HF}"], "error: RUN_NAME holds what looks like a Hugging Face token"),
        ([f"DATA=/data/{JWT}/data.toml"], "error: DATA holds what looks like a JSON Web Token"),
    ],
    ids=["SET-slack", "RUN_NAME-hf", "DATA-jwt"],
)
def test_a_credential_in_a_variable_is_refused_unechoed(variables, start):
    before = run_dirs()
    out = make("plan", f"RECIPE={R8}", *variables)
    line = answered(out, start)
    assert "put its name in secrets = [...]" in line and all(t not in out.stdout + out.stderr for t in (HF, JWT, SLACK))
    assert run_dirs() == before


def test_a_credential_in_a_recorded_shell_variable_never_reaches_a_file():
    """`NCCL_COLLNET_HINT=hf_<token> make plan`: the ledger records the caller's NCCL_* with values; this one is
    refused in one line naming it (never its value), and no plan.json or ledger.json is written."""
    before = run_dirs()
    env = {**os.environ, "NCCL_COLLNET_HINT": HF}
    out = subprocess.run(
        ["make", "plan", f"RECIPE={R8}"], cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    line = answered(out, "error: NCCL_COLLNET_HINT in your shell holds what looks like a Hugging Face token")
    assert "unset it" in line and HF not in out.stdout + out.stderr
    assert run_dirs() == before
