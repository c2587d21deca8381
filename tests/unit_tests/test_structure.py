"""The shape of the library, checked: stages import only earlier stages, no function grows past 60 lines, the
CUDA_DEVICE_MAX_CONNECTIONS rule has one home, and every module has a test file that imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from overlapkit import stack

SRC = stack.REPO_ROOT / "src" / "overlapkit"
# A plan flows through these stages in order; a module may import its own stage or an earlier one, never a later one.
STAGES = {"": 0, "sizing": 1, "plan": 2, "fork": 3, "cluster": 4, "regress": 5}
MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py")
# Modules whose tests live in the files users know from Bridge's guide, or beside the module they serve.
COVERED_BY = {
    "te_stub": "test_stack.py",
    "plan/overlap": "training/test_comm_overlap.py",
    "plan/audit": "training/test_comm_overlap.py",
    "plan/moe": "training/test_comm_overlap.py",
    "plan/presets": "training/test_comm_overlap.py",
    "plan/env": "recipes/test_run_plugins.py",
    "plan/build": "recipes/test_recipes.py",
    "plan/report": "recipes/test_recipes.py",
    "plan/published": "sizing/test_throughput.py",
    "cluster/profiles": "recipes/test_run_plugins.py",
    "cluster/plugin": "recipes/test_run_plugins.py",
    "cluster/submit": "cluster/test_sbatch.py",
    "cluster/slurm": "../e2e/test_slurm_e2e.py",
    "plan/dataprep": "plan/test_data.py",
    "regress/night_report": "regress/test_rules.py",
    "regress/begin": "regress/test_schedule.py",
    "regress/chain_status": "regress/test_schedule.py",
    "topology": "training/test_comm_overlap.py",
    "shape": "recipes/test_recipes.py",
}
TESTS = stack.REPO_ROOT / "tests" / "unit_tests"


def _stage(dotted: str) -> int | None:
    parts = dotted.split(".")
    if parts[0] != "overlapkit" or len(parts) < 2:
        return None
    return STAGES.get(parts[1], 0)


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_a_later_stage(path):
    own = STAGES.get(path.parent.name if path.parent != SRC else "", 0)
    for module, names in _imports(ast.parse(path.read_text())):
        targets = [f"{module}.{n}" for n in names] if module == "overlapkit" else [module]
        for t in targets:
            stage = _stage(t)
            assert stage is None or stage <= own, f"{path.relative_to(SRC)} imports {t} from a later stage"
        assert module.split(".")[0] != "recipes", f"{path.relative_to(SRC)} imports recipes: use plan.registry"


@pytest.mark.parametrize("root", ["src", "launch"])
def test_no_function_over_60_lines(root):
    long = []
    for path in sorted((stack.REPO_ROOT / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(stack.REPO_ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_cuda_device_max_connections_rule_has_one_home():
    homes = [p.relative_to(SRC) for p in MODULES if "CUDA_DEVICE_MAX_CONNECTIONS" in p.read_text()]
    assert homes == [Path("plan/env.py")]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_has_a_test_that_imports_it(path):
    rel = str(path.relative_to(SRC).with_suffix(""))
    test = TESTS / COVERED_BY.get(rel, str(Path(rel).parent / f"test_{path.stem}.py"))
    assert test.is_file(), f"{rel} has no test file ({test.relative_to(TESTS.parent)})"
    dotted = "overlapkit." + rel.replace("/", ".")
    mentioned = {m for m, names in _imports(ast.parse(test.read_text())) for m in [m, *(f"{m}.{n}" for n in names)]}
    assert dotted in mentioned, f"{test.name} does not import {dotted}"
