"""The recipe registry: every module in `recipes/` (and in the directories of RECIPES_PATH) registers its builders here.

`discover()` imports every module of the `recipes` package, so a fork written by `make new-recipe`, or a user's own
file, is planned by the next command without being listed anywhere; a module that fails to import is one line naming
the file (`load_errors()`) and every other recipe still lists. A recipe's `OverlapIntent` is given once, in
`register(intent=...)`, and its nodes are its name's GPU count / 8: a recipe states its size once, in its name.

Before the import the registry knows names as data, never by reading code: the shipped modules' table
(`recipes.RECIPES`) and each file named for its recipe (`<name>.py`, as make new-recipe writes a fork).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from overlapkit import paths
from overlapkit.bridge import stack
from overlapkit.errors import BadInput
from overlapkit.names import checked_name
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.topology import GPUS_PER_NODE

PACKAGE = "recipes"
PATH_VAR = "RECIPES_PATH"  # extra directories of recipe modules, os.pathsep-separated
RECIPES_DIR = paths.REPO_ROOT / PACKAGE
# What a recipe's name says: `<model>_pretrain_<N>gpu_h100_<dtype>`, N its GPUs (register checks them against nodes)
NAME_RE = re.compile(
    r"^(?P<model>[a-z][a-z0-9]*(?:_[a-z0-9]+)*?)_pretrain_(?P<gpus>\d+)gpu_h100_(?P<dtype>bf16|fp8cs)$",
    re.ASCII,  # \d is 0-9 only: a full-width ８ is no digit of a recipe name (nor of a Python module's)
)


@dataclass(frozen=True)
class EnvVar:
    value: str | int
    reason: str  # one line, with its source


@dataclass(frozen=True)
class Recipe:
    """Registry entry: the pure builder plus what a launcher needs to know about it."""

    name: str
    build: Callable
    model: str
    nodes: int
    time_limit: str
    env: dict[str, EnvVar]
    source: str
    intent: OverlapIntent = field(default_factory=OverlapIntent)


class UnknownRecipe(BadInput, KeyError):
    def __str__(self) -> str:
        return self.args[0]


REGISTRY: dict[str, Recipe] = {}
_ERRORS: dict[str, str] = {}  # module name → one-line import error naming its file


def register(*, model: str, source: str, nodes: int | None = None, time_limit: str = "04:00:00", env=None, intent=None):
    """Decorator: add a `<model>_pretrain_<N>gpu_h100_<dtype>` builder, its nodes N / 8 (`nodes`: only for a name
    without N, which must then say), whose overlap stack follows `intent` (an OverlapIntent; default: every overlap
    on, presets by shape)."""

    def wrap(build: Callable):
        name = checked_name(build.__name__, "recipe", "a recipe's name names its run directories and goldens")
        if name in REGISTRY:
            raise ValueError(f"recipe {name} is registered twice ({REGISTRY[name].build.__module__})")
        said = NAME_RE.fullmatch(name)
        count = nodes if said is None else int(said["gpus"]) // GPUS_PER_NODE
        if said and (nodes not in (None, count) or int(said["gpus"]) % GPUS_PER_NODE):
            raise ValueError(f"recipe {name} names {said['gpus']} GPUs but registers nodes={nodes}: make them agree")
        if count is None:
            raise ValueError(f"recipe {name} names no GPU count (<model>_pretrain_<N>gpu_h100_<dtype>): give nodes=")
        env_vars = dict(env or {})
        REGISTRY[name] = Recipe(name, build, model, count, time_limit, env_vars, source, intent or OverlapIntent())
        return build

    return wrap


def _extra_dirs() -> list[str]:
    return [d for d in os.environ.get(PATH_VAR, "").split(os.pathsep) if d.strip()]


@cache
def discover() -> None:
    """Import every module of the `recipes` package (and RECIPES_PATH) once per process; never raises: a module that
    fails to import registers nothing and leaves one line naming its file (load_errors)."""
    stack.import_bridge()
    pkg = importlib.import_module(PACKAGE)
    for d in _extra_dirs():  # RECIPES_PATH's directories join the package's path
        if not Path(d).is_dir():
            _ERRORS[f"path:{d}"] = f"{PATH_VAR} entry {d} is not a directory: fix or remove it"
        elif str(Path(d).resolve()) not in map(str, pkg.__path__):
            pkg.__path__.append(str(Path(d).resolve()))
    seen: dict[str, Path] = {}
    for directory in list(pkg.__path__):
        for info in sorted(pkgutil.iter_modules([directory]), key=lambda i: i.name):
            path = Path(directory) / (info.name if info.ispkg else f"{info.name}.py")
            if info.name.startswith("_"):
                continue
            if info.name in seen:
                _ERRORS[f"dup:{path}"] = (
                    f"{paths.repo_relative(path)} is shadowed by {paths.repo_relative(seen[info.name])}: rename one"
                )
                continue
            seen[info.name] = path
            module, before = f"{PACKAGE}.{info.name}", set(REGISTRY)
            if module in sys.modules:
                continue
            try:
                with stack.silenced():
                    importlib.import_module(module)
                if NAME_RE.fullmatch(info.name) and (got := sorted(set(REGISTRY) - before)) != [info.name]:
                    # what declared_nodes read before the import (the file's name) must be what it registers
                    raise ValueError(f"a file named for recipe {info.name} registers that one alone, not {got}")
            except Exception as exc:  # any error in a user's file: drop what it registered, keep the other recipes
                sys.modules.pop(module, None)
                for name in set(REGISTRY) - before:
                    del REGISTRY[name]
                where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
                why = f"{type(exc).__name__}{where}: {' '.join(str(exc).split())}"  # one line, whatever it printed
                _ERRORS[module] = f"{paths.repo_relative(path)} does not import: {why}"


def finds(path: Path) -> bool:
    """Would a new process's discover() import the recipe file at `path`?"""
    return any(Path(path).resolve().parent == d.resolve() for d in [RECIPES_DIR, *map(Path, _extra_dirs())])


def load_errors() -> list[str]:
    discover()
    return list(_ERRORS.values())


def names() -> list[str]:
    discover()
    return sorted(REGISTRY)


def get(name: str) -> Recipe:
    discover()
    if name in REGISTRY:
        return REGISTRY[name]
    broken = f"; {len(_ERRORS)} recipe module(s) failed to import: {next(iter(_ERRORS.values()))}" if _ERRORS else ""
    raise UnknownRecipe(_unknown(name, REGISTRY) + broken)


def _unknown(name: str, known) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4) or sorted(known)[:3]
    return f"unknown recipe {name!r}; closest: {', '.join(close)} (`make recipes` lists all)"


def check_declared(name: str) -> None:
    """Before the Bridge import: raise UnknownRecipe when no recipe is declared as `name` (declared_nodes). A module
    that is neither in the table nor named for its recipe makes the answer unknown, and the full check decides."""
    if (declared := declared_nodes()) and name not in declared:
        raise UnknownRecipe(_unknown(name, declared))


def declared_nodes() -> dict[str, int | None] | None:
    """Before the Bridge import: every recipe name the modules declare as data, with the nodes its name says (None for
    a name off the pattern); None when some module leaves its names to its import (see check_declared)."""
    declared: dict[str, int | None] = {}
    for directory in [RECIPES_DIR, *map(Path, _extra_dirs())]:
        table = importlib.import_module(PACKAGE).RECIPES if Path(directory).resolve() == RECIPES_DIR.resolve() else {}
        for path in sorted(Path(directory).glob("[!_]*.py")):
            if path.stem not in table and not NAME_RE.fullmatch(path.stem):
                return None
            for name in table.get(path.stem, (path.stem,)):
                said = NAME_RE.fullmatch(name)
                declared[name] = int(said["gpus"]) // GPUS_PER_NODE if said else None
    return declared


def shipped(name: str) -> bool:
    """Is recipe `name` defined in this repo's recipes/ (not in a RECIPES_PATH directory)?"""
    module = sys.modules.get(get(name).build.__module__)
    return module is not None and Path(module.__file__).resolve().parent == RECIPES_DIR.resolve()


def load_file(path: Path, name: str):
    """Import the recipe file at `path` (any suffix: a fork's temp file too) as `recipes.<name>`; its @register adds
    it to the registry. No __pycache__ is left next to it."""
    discover()
    module = f"{PACKAGE}.{name}"
    loader = importlib.machinery.SourceFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        with stack.silenced():
            spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = saved
    return mod


def builders():
    """`recipes._base`, the builders the recipe files share (h100_pretrain, moe_pretrain, with_shape): what a fork's
    layout search builds its file's config with at each layout (fork/scaffold.py recipe_at)."""
    discover()
    return importlib.import_module(f"{PACKAGE}._base")


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)
    sys.modules.pop(f"{PACKAGE}.{name}", None)
