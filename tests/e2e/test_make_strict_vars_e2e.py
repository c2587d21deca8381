"""What make itself is given, held to the promise (the hostile sweep's M001, M040, M044, M056, M057, R015, N007): a
command-line variable the Makefile does not know (a typo such as RECIPIE=) stops make in one line naming the nearest
known one, exit 2, before any work, while environment variables, make's own and this project's environment ones
pass; an unknown CLUSTER= for recipes and new-recipe is refused as plan refuses it; and with the plan server off,
kill -9 of make stops every command (not only those with signal handlers) and nothing is written after.

Through make where the case is make's (new processes, as a user types it); CLUSTER= in process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from overlapkit import paths
from overlapkit.cluster import plan_server

ROOT = paths.REPO_ROOT
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def make(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = ["make", *args]
    env = {**os.environ, **(env or {})}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("variables", "says"),
    [
        ([f"RECIPIE={R8}", "FORMAT=json"], "RECIPIE= (did you mean RECIPE=?) is not a variable of this Makefile"),
        ([f"recipe={R8}"], "recipe= (did you mean RECIPE=?) is not a variable"),
        (["NODS=2", "CLUSTR=local"], "CLUSTR= (did you mean CLUSTER=?)"),  # and NODS=, in make's order
        (["NODS=2", "CLUSTR=local"], "NODS= (did you mean NODES=?)"),
        (["FO'O=1; touch x"], "FO'O= is not a variable of this Makefile"),  # a quote in the name: text, never run
    ],
)
def test_an_unknown_command_line_variable_stops_make_naming_the_nearest(tmp_path, variables, says):
    """M001: RECIPIE=llama3_8b... was ignored and the default 70B recipe planned, exit 0."""
    before = set((ROOT / "runs").glob("*")) if (ROOT / "runs").is_dir() else set()
    out = make("plan", *variables)
    assert out.returncode == 2 and not out.stdout, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("Makefile:"), out.stderr
    assert "an environment variable before make: NAME=value make <target>" in lines[0]
    assert (set((ROOT / "runs").glob("*")) if (ROOT / "runs").is_dir() else set()) == before  # nothing planned
    assert not (ROOT / "x").exists()


@pytest.mark.parametrize(
    "variables",
    [
        ["SHELL=/bin/sh", "CC=cc", "MAKEFLAGS=-s"],  # make's own
        [f"{plan_server.SWITCH}=0", "RECIPES_PATH=/nonexistent"],  # this project's environment variables
        ["UV=tools/uv.sh"],  # the Makefile's plumbing
        ["FORMAT=json", "GPU="],  # data
    ],
)
def test_make_own_ours_and_environment_variables_pass(variables):
    out = make("help", *variables, env={"RECIPIE": "set in the shell: the environment is never checked"})
    assert out.returncode == 0 and "make plan" in out.stdout, out.stderr


@pytest.mark.parametrize(
    ("target", "variables"),
    [
        ("recipes", ["CLUSTER=lcoal"]),  # M056
        ("recipes", ["CLUSTER=loc\nal\x1b[2J"]),  # M040: control characters, escaped in the one line
        ("new-recipe", [f"FROM={R8}", "NAME=llama3_4b_pretrain_8gpu_h100_bf16", "CLUSTER=loc\nal\x1b[2J"]),  # M044
        ("new-recipe", [f"FROM={R8}", "NAME=llama3_5b_pretrain_8gpu_h100_bf16", "LAYERS=24", "CLUSTER=lcoal"]),  # M057
    ],
)
def test_an_unknown_cluster_for_recipes_and_new_recipe_is_refused(make_here, target, variables):
    """They predicted with the published constants (no calibration of a cluster that does not exist), and new-recipe
    wrote the recipe."""
    code, out, err = make_here(target, *variables)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert re.match(r"error: unknown cluster profile '.*'; did you mean local\? available: ", err), err
    assert "\x1b" not in err
    assert not list((ROOT / "recipes").glob("llama3_[45]b_pretrain_8gpu_h100_bf16.py"))


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def watching(pid: int) -> bool:
    """Is `pid` a `python -m launch` that has started its make watcher (a second thread)? Killed before it
    watches, make's death goes unseen: the command cannot tell it from a Slurm job, which inherits make's pid too."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        threads = re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    python = os.path.basename(cmdline[0]).startswith(b"python")  # not uv, whose command line names it too
    return python and b"launch" in cmdline and threads is not None and int(threads.group(1)) >= 2


NEW = "llama3_14b_pretrain_16gpu_h100_bf16"


@pytest.mark.parametrize(
    ("target", "variables", "written"),
    [
        ("plan", [f"RECIPE={R8}"], None),  # R015: the plan wrote its run directory 20 s after make died
        ("new-recipe", [f"FROM={R8}", f"NAME={NEW}", "LAYERS=56"], f"recipes/{NEW}.py"),  # N007: it wrote the recipe
        ("recipes", [], None),
    ],
)
def test_kill_9_of_make_stops_every_command_with_the_server_off(tmp_path, target, variables, written):
    runs = tmp_path / "runs"
    env = {**os.environ, plan_server.SWITCH: "0"}
    before = set((ROOT / "runs").glob(f"{R8}-*")) if (ROOT / "runs").is_dir() else set()
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen(
        ["make", "-s", target, *variables], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err
    )
    deadline = time.monotonic() + 120
    while not any(watching(p) for p in descendants(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = descendants(proc.pid)
    assert any(watching(p) for p in tree), "the command never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while [p for p in tree if Path(f"/proc/{p}").exists() and _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in tree if Path(f"/proc/{p}").exists() and _alive(p)]
    assert not left, f"still running after make was killed: {left}: {(tmp_path / 'err').read_text()}"
    time.sleep(1)
    assert not (written and (ROOT / written).exists())
    after = set((ROOT / "runs").glob(f"{R8}-*")) if (ROOT / "runs").is_dir() else set()
    assert after == before and not runs.exists()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
