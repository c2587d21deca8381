"""The shape of the library, checked: a room imports only the rooms the import rule names, no function grows past 80
lines and no launch/ entry past 250 (both measured as ruff formats them), `# fmt: skip` stays rare and says why, and
every module has a test file whose tests use what it defines."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from functools import cache
from pathlib import Path

import pytest

from overlapkit import paths

SRC = paths.REPO_ROOT / "src" / "overlapkit"
# The import rule (docs/architecture.md): a room imports the rooms it names here, and itself; the root's modules
# (errors, jsonio, names, paths, secrets, makewatch) import only the root. Only bridge/ imports Megatron or torch, and
# nothing below it imports bridge/, so what reads records (sizing, cluster, profile, nightly) cannot need Bridge.
ROOMS = {
    "": set(),
    "spec": set(),
    "sizing": {"spec"},
    "profile": {"spec"},
    "cluster": {"spec", "sizing"},
    "nightly": {"spec", "sizing", "profile", "cluster"},
    "bridge": {"spec", "sizing", "profile", "cluster"},
    "fork": {"spec", "sizing", "bridge"},
}
MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py")
# Modules whose tests live in the files users know from Bridge's guide, or beside the module they serve.
COVERED_BY = {
    "bridge/te_stub": "test_stack.py",
    "bridge/stack": "test_stack.py",
    "paths": "test_stack.py",  # the runs root beside the pinned stack
    "spec/request": "bridge/test_request.py",  # parsed by bridge/request.py, bound here
    "bridge/gpucut": "nightly/test_gpucut.py",  # the 1-GPU cut, parsed as the nightly parses a log
    "bridge/overlap": "training/test_comm_overlap.py",
    "bridge/audit": "training/test_comm_overlap.py",
    "bridge/moe": "training/test_comm_overlap.py",
    "bridge/presets": "training/test_comm_overlap.py",
    "bridge/env": "recipes/test_run_plugins.py",
    "bridge/build": "recipes/test_recipes.py",
    "bridge/report": "recipes/test_recipes.py",
    "bridge/published": "sizing/test_throughput.py",
    "cluster/profiles": "recipes/test_run_plugins.py",
    "bridge/plugin": "recipes/test_run_plugins.py",
    "cluster/submit": "cluster/test_sbatch.py",
    "bridge/submission": "cluster/test_sbatch.py",
    "spec/runopts": "bridge/test_runopts.py",
    "cluster/slurm": "../e2e/test_slurm_e2e.py",
    "cluster/plan_server": "test_plan_server_bounded.py",  # beside the server's tests (launch/serve.py)
    "bridge/dataprep": "bridge/test_data.py",
    "nightly/night_report": "nightly/test_rules.py",
    "nightly/chain_status": "nightly/test_schedule.py",
    "spec/topology": "training/test_comm_overlap.py",
    "errors": "test_commands.py",  # the exit status each class gets, through the dispatcher
    "spec/shape": "recipes/test_recipes.py",
    "spec/planfile": "bridge/test_planfile.py",
    # the typed models of the files the project reads, tested together (and each through its reader's tests)
    **dict.fromkeys(
        ("spec/model", "spec/profile", "spec/dataspec", "spec/submission", "spec/schedule"), "spec/test_records.py"
    ),
    "spec/findings": "recipes/test_recipes.py",  # every plan's audit is made of them
    # the overlap report's parts, tested together on one set of Nsight SQLite fixtures
    "profile/nsys_sqlite": "profile/test_overlap_report.py",
    "profile/torch_trace": "profile/test_overlap_real_traces.py",  # read against the real traces of tests/data/
    "profile/overlap_classes": "profile/test_overlap_report.py",
    "profile/overlap_claims": "profile/test_overlap_report.py",
    "profile/overlap_render": "profile/test_overlap_report.py",
}
TESTS = paths.REPO_ROOT / "tests" / "unit_tests"


def _room(dotted: str) -> str | None:
    """The room of `overlapkit.<room>.<module>` ("" for the root's modules), None outside the library."""
    parts = dotted.split(".")
    if parts[0] != "overlapkit" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ROOMS else ""


DYNAMIC = ("import_module", "__import__")  # importlib.import_module("a.b"), __import__("a.b")


def _imports(tree: ast.AST):
    """(module, names) of every import: the statements, at any depth, and the dynamic imports of a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in DYNAMIC and isinstance(node.args[0].value, str):
                yield node.args[0].value, []


def _upward(path: Path, source: str) -> list[str]:
    """What the module at `path` (in src/overlapkit/) imports against the import rule: a room its own does not name,
    the recipes (through bridge.registry only) or the entry layer (launch/ knows the library, never the other way)."""
    own = path.parent.name if path.parent != SRC else ""
    allowed = ROOMS[own] | {own, ""}
    bad = []
    for module, names in _imports(ast.parse(source)):
        package = module == "overlapkit" or module.removeprefix("overlapkit.") in ROOMS
        for t in [f"{module}.{n}" for n in names] if package and names else [module]:
            room = _room(t)
            if room is None or room in allowed:
                continue
            bad.append(f"{t}: {own or 'the root'} does not import {room or 'the root'}")
        if module.split(".")[0] in ("recipes", "launch"):
            bad.append(f"{module}: {'use bridge.registry' if module.startswith('recipes') else 'the entry layer'}")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_against_the_rule(path):
    assert _upward(path, path.read_text()) == [], f"{path.relative_to(SRC)} imports against the import rule"


# The rooms that read records: none may bring Megatron, torch or Transformer Engine in, however deep the import chain.
RECORD_ROOMS = ("spec", "sizing", "cluster", "nightly", "profile")
BRIDGE_PACKAGES = ("megatron", "torch", "transformer_engine")


def _loaded_by(modules: list[str]) -> list[str]:
    """The Bridge-side packages in sys.modules of a fresh interpreter after importing `modules`."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({BRIDGE_PACKAGES!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=paths.REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.relative_to(SRC).parts[0] != "bridge"], ids=lambda p: str(p.relative_to(SRC))
)
def test_only_the_bridge_room_names_megatron_torch_or_te_at_any_depth(path):
    """A function-local import escapes the fresh-interpreter check below until the function runs: none outside
    bridge/ (sizing once parsed a pipeline layout with Megatron Core, cluster imported Bridge's training entry)."""
    named = [m for m, _ in _imports(ast.parse(path.read_text())) if m.split(".")[0] in BRIDGE_PACKAGES]
    assert named == [], f"{path.relative_to(SRC)} imports {named}: that belongs in bridge/"


def test_the_rooms_that_read_records_never_import_bridge():
    dotted = [
        "overlapkit." + str(p.relative_to(SRC).with_suffix("")).replace("/", ".")
        for p in MODULES
        if p.relative_to(SRC).parts[0] in RECORD_ROOMS
    ]
    assert _loaded_by(dotted) == []


@pytest.mark.parametrize(
    "line",
    [
        "from overlapkit.nightly import rules",
        "import overlapkit.cluster.slurm",
        "def f():\n    from overlapkit import bridge",
        "importlib.import_module('overlapkit.nightly.rules')",
        "__import__('overlapkit.fork.scaffold')",
        "import_module('launch.plan')",
        "from launch.commands import COMMANDS",
    ],
)
def test_an_upward_import_is_seen_however_it_is_written(line):
    assert _upward(SRC / "sizing" / "memory.py", f"import importlib\n{line}\n") != []
    assert _upward(SRC / "sizing" / "memory.py", "importlib.import_module('overlapkit.sizing.hardware')\n") == []


# Formatter escapes: a size rule is measured with them neutralised, so that packing lines cannot meet it.
ESCAPE = re.compile(r"fmt:\s*(skip|off|on)\b")
MAX_ESCAPES = 10  # `# fmt: skip` in src/ and launch/ together, each with its reason


@cache
def _formatted(path: Path) -> str:
    """The file as `ruff format` (the repo's pyproject.toml) lays it out, with every formatter escape ignored."""
    text = ESCAPE.sub("fmt-ignored", path.read_text())
    cmd = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"]
    return subprocess.run(cmd, input=text, capture_output=True, text=True, check=True, cwd=paths.REPO_ROOT).stdout


def _files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (paths.REPO_ROOT / root).rglob("*.py"))


@pytest.mark.parametrize("root", ["src", "launch", "bench", "tools"])
def test_no_function_over_80_lines(root):
    # A guard against giants, not a size to split toward (issue 35: "80 lines is plenty").
    # Bridge's own comm_overlap._get_model_comm_overlap_cfgs is 139.
    long = []
    for path in _files(root):
        for node in ast.walk(ast.parse(_formatted(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(paths.REPO_ROOT)}:{node.lineno} (formatted) {node.name}")
    assert long == []


def test_no_launch_file_over_250_lines():
    long = [
        f"{p.name}: {n} lines (formatted)" for p in _files("launch") if (n := len(_formatted(p).splitlines())) > 250
    ]
    assert long == []


def _escapes(path: Path):
    """(line, reason given) for each comment that carries a formatter escape: the reason is the comment's own text
    beside the escape, or a comment line just above (above the escaped line or the statement it ends)."""
    lines = path.read_text().splitlines()
    starts = {n.end_lineno: n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.stmt)}
    with path.open("rb") as f:
        comments = [t for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
    for tok in comments:
        if not ESCAPE.search(tok.string):
            continue
        row = tok.start[0]
        own = ESCAPE.sub("", tok.string).strip("# ")
        above = {row - 1, starts.get(row, row) - 1}
        yield row, bool(own) or any(r > 0 and lines[r - 1].strip().startswith("#") for r in above)


def test_fmt_skip_is_rare_and_says_why():
    found = [(p.relative_to(paths.REPO_ROOT), row, why) for p in _files("src", "launch") for row, why in _escapes(p)]
    assert len(found) <= MAX_ESCAPES, f"{len(found)} formatter escapes in src/ and launch/ (at most {MAX_ESCAPES})"
    unexplained = [f"{p}:{row}" for p, row, why in found if not why]
    assert unexplained == [], "a `# fmt: skip` needs its reason, on its line or the line above"


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level: functions, classes, constants."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            out |= {
                t.id
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            }
    return out


def _used_in_functions(tree: ast.Module, dotted: str) -> set[str]:
    """What the functions of a test file use of module `dotted`: `alias.name` where alias is bound to the module
    (`import a.b as m`, `from a import b`), or a name imported from it (`from a.b import name`). An import alone, or
    a use at module level only, is no use: it runs whether or not any test calls into the module."""
    parent, _, leaf = dotted.rpartition(".")
    aliases, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == dotted and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == parent:
            aliases |= {a.asname or a.name for a in node.names if a.name == leaf}
        elif isinstance(node, ast.ImportFrom) and node.module == dotted:
            names |= {a.asname or a.name: a.name for a in node.names}
    used = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.add(node.attr)
            elif isinstance(node, ast.Name) and node.id in names:
                used.add(names[node.id])
    return used


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_has_a_test_that_calls_into_it(path):
    rel = str(path.relative_to(SRC).with_suffix(""))
    test = TESTS / COVERED_BY.get(rel, str(Path(rel).parent / f"test_{path.stem}.py"))
    assert test.is_file(), f"{rel} has no test file ({test.relative_to(TESTS.parent)})"
    dotted = "overlapkit." + rel.replace("/", ".")
    used = _used_in_functions(ast.parse(test.read_text()), dotted) & _defined(ast.parse(path.read_text()))
    assert used, f"no function of {test.name} uses anything {dotted} defines (an import alone tests nothing)"
