"""Plan every recipe under one stack, in one process (Bridge imported once), and write each one's plan record.

`python -m overlapkit.bridge.stackplan OUT.json [--recipes "a b"] [--set "k=v ..."]` is what `make stack-diff` runs
under each stack's python (the checkout's .venv, and the candidate's from bridge/stackenv.py). A record is `make plan
FORMAT=json`'s, plus `config`: every resolved ConfigContainer field as dotted keys, and `not_fields`: attributes a
recipe set that are no dataclass field of that stack (a fork writing a renamed field sets a dead attribute, silently).
A recipe that fails to plan is its first error in one line, whatever raised it (under a candidate stack our own code
may break). overlapkit/nightly/stackdiff.py diffs these records.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import importlib
import re
import subprocess
import sys
import traceback
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import one_line

SECTIONS = ("model", "optimizer", "ddp", "comm_overlap", "train", "scheduler", "mixed_precision", "checkpoint")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's address differs every run: never a difference


def value_of(v):
    """A field's value as JSON that is stable across processes (enums by name, callables by dotted name, anything
    else by its repr without its address)."""
    if isinstance(v, (bool, int, float, str, type(None))):
        return v
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, (list, tuple)):
        return [value_of(x) for x in v]
    if isinstance(v, dict):
        return {str(k): value_of(x) for k, x in v.items()}
    if isinstance(v, type) or callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return ADDRESS.sub("", repr(v))


def flatten(obj, prefix: str, out: dict, missing: dict, depth: int = 3) -> None:
    """`out[dotted key] = value` for every dataclass field under `obj`; `missing[...]` for each public non-field."""
    names = {f.name for f in dataclasses.fields(obj)}
    for name in sorted(names):
        v = getattr(obj, name, None)
        if depth > 1 and dataclasses.is_dataclass(v) and not isinstance(v, type):
            flatten(v, f"{prefix}{name}.", out, missing, depth - 1)
        else:
            out[f"{prefix}{name}"] = value_of(v)
    for name in sorted(set(getattr(obj, "__dict__", {})) - names):
        if not name.startswith("_"):
            missing[f"{prefix}{name}"] = f"set on {type(obj).__name__}, which has no such field"


def bridge_fields(source: str) -> dict | None:
    """The fields of the config Bridge's own recipe function (`source`) returns, before our recipe tunes it: what a
    release changed in its recipes even where ours sets the field. {"error": ...} when it raises; None: no function."""
    module, _, func = source.rpartition(".")
    if not module.startswith("megatron.bridge."):
        return None
    from overlapkit.bridge import stack

    try:
        with stack.silenced():
            cfg = getattr(importlib.import_module(module), func)()
    except Exception as exc:  # the candidate's function fails: said, the plan's record stands or fails on its own
        return {"error": first_error(exc)}
    return {"fields": config_fields(cfg)[0]}


def config_fields(cfg) -> tuple[dict, dict]:
    """(fields, not_fields) of a config's SECTIONS."""
    fields, missing = {}, {}
    for section in SECTIONS:
        if dataclasses.is_dataclass(part := getattr(cfg, section, None)):
            flatten(part, f"{section}.", fields, missing)
    return fields, missing


def first_error(exc: BaseException) -> str:
    """`Type: message` in one line, with the deepest Megatron frame it came through (where the stack differs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at megatron/{f.filename.rsplit('/megatron/', 1)[1]}:{f.lineno} in {f.name})"
    return f"{type(exc).__name__}: {one_line(' '.join(str(exc).split()))}{where}"


def record(name: str, sets: str = "") -> dict:
    """The plan record of recipe `name` under this process's stack, or its first error."""
    from overlapkit.bridge.build import make_plan

    try:
        plan = make_plan(name, sets=sets or None, caller_env={})  # no shell layer: both stacks see the same
    except Exception as exc:  # any failure under a candidate stack is the answer, in one line
        return {"recipe": name, "error": first_error(exc)}
    rec = plan.to_dict()
    cfg, r = copy.copy(plan.cfg), plan.resolved  # the recipe's config with Bridge's resolved parts
    cfg.model, cfg.optimizer, cfg.ddp, cfg.comm_overlap = r.model, r.optimizer, r.ddp, r.comm
    rec["config"], rec["not_fields"] = config_fields(cfg)
    rec["bridge_config"] = bridge_fields(plan.recipe.source)
    return rec


def plan_all(names: list[str], sets: str = "") -> dict:
    """Every recipe's record (all of the registry when `names` is empty) with this stack's versions."""
    from overlapkit.bridge import registry, stack

    stack.import_bridge()
    known = registry.names()
    return {
        "versions": stack.versions(),
        "load_errors": registry.load_errors(),
        "records": [
            record(n, sets) if n in known else {"recipe": n, "error": "not a recipe here"} for n in names or known
        ],
    }


def start(python: Path | str, out: Path, names: list[str], sets: str, env: dict) -> subprocess.Popen:
    """Plan under `python` (a stack's interpreter) into `out`, in a process of its own; its stderr is kept."""
    cmd = [str(python), "-m", "overlapkit.bridge.stackplan", str(out), "--recipes", " ".join(names), "--set", sets]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlapkit.bridge.stackplan", description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--recipes", default="")
    ap.add_argument("--set", default="")
    opts = ap.parse_args(argv)
    jsonio.write_json(Path(opts.out), plan_all(opts.recipes.split(), opts.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
