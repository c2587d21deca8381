"""Planning's deferred imports (overlapkit/bridge/lazy_imports.py): every recipe's `FORMAT=json` plan is the same with
nothing deferred, a deferred module is the real one at its first use, and a job that trains imports in full."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from launch import commands, entry
from overlapkit import paths
from overlapkit.bridge import lazy_imports, registry, stack

# A fresh interpreter plans every recipe, as `make plan FORMAT=json` prints it, with or without deferral.
CHILD = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); import test_lazy_imports as t; "
    "print(json.dumps(t.collect(sys.argv[2] == 'full', t.Path(sys.argv[3]))))"
)


def collect(full: bool, runs: Path) -> dict:
    """Every recipe's json plan (launch/plan.py main, as `make plan FORMAT=json`), and what is still deferred."""
    stack.import_bridge(full=full)
    plans = {}
    for name in registry.names():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = commands.call("plan", [name, "--format", "json", "--runs", str(runs)])
        doc = json.loads(out.getvalue())
        assert Path(doc.pop("run_dir")).parent == runs  # the only field that differs run to run (its UTC stamp)
        plans[name] = {"exit": code, "plan": doc}
    return {"plans": plans, "deferred": lazy_imports.deferred(), "finder": lazy_imports._FINDER in sys.meta_path}


def _fresh(mode: str, runs: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != lazy_imports.SWITCH}
    argv = [sys.executable, "-c", CHILD, str(Path(__file__).parent), mode, str(runs)]
    out = subprocess.run(argv, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_recipes_json_plan_is_the_same_with_nothing_deferred(tmp_path):
    full = _fresh("full", tmp_path / "full")
    # This process imported Bridge deferred (tests/conftest.py); an earlier test may have asked for the full stack.
    deferred_here = lazy_imports.deferred() == sorted(lazy_imports.LAZY)
    here = collect(False, tmp_path / "here") if deferred_here else _fresh("deferred", tmp_path / "here")
    assert full["deferred"] == [] and full["finder"] is False  # full=True: the training import, nothing deferred
    assert here["deferred"] == sorted(lazy_imports.LAZY)  # planning all of them used none of the deferred modules
    assert sorted(here["plans"]) == sorted(full["plans"]) == registry.names() and len(registry.names()) >= 18
    for name in registry.names():
        assert here["plans"][name] == full["plans"][name], name


def test_the_real_wandb_behind_megatron_core_timers_at_first_use():
    from accelerate.utils import is_wandb_available
    from megatron.core import timers

    # Availability probes conclude what they would eagerly (the package is there), and do not load it.
    was_deferred = "wandb" in lazy_imports.deferred()
    assert importlib.util.find_spec("wandb") is not None and is_wandb_available()
    assert timers.wandb is not None and timers.wandb is sys.modules["wandb"]
    assert ("wandb" in lazy_imports.deferred()) is was_deferred
    assert timers.wandb.__version__ == importlib.metadata.version("wandb")  # a use: the real body runs
    assert type(timers.wandb) is types.ModuleType and callable(timers.wandb.init)
    assert "wandb" not in lazy_imports.deferred()


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A real package `okl_probe` (its body logs each run), deferred for `okl_importer` only."""
    (tmp_path / "okl_probe").mkdir()
    (tmp_path / "okl_probe" / "__init__.py").write_text("import okl_log\nokl_log.RUNS.append(1)\nVALUE = 42\n")
    (tmp_path / "okl_log.py").write_text("RUNS = []\n")
    (tmp_path / "okl_importer.py").write_text("import okl_probe\n")
    (tmp_path / "okl_other.py").write_text("import okl_probe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(lazy_imports.LAZY, "okl_probe", ("okl_importer", "a test package"))
    others = [f for f in sys.meta_path if f is not lazy_imports._FINDER]
    monkeypatch.setattr(sys, "meta_path", [lazy_imports._FINDER, *others])
    yield tmp_path
    for name in ("okl_probe", "okl_log", "okl_importer", "okl_other"):
        sys.modules.pop(name, None)
    lazy_imports._PENDING.pop("okl_probe", None)


def test_a_deferred_module_runs_its_body_at_its_first_use_only(probe):
    import okl_importer
    import okl_log

    mod = sys.modules["okl_probe"]
    assert okl_importer.okl_probe is mod and "okl_probe" in lazy_imports.deferred()
    # The import system's own reads are not uses: a probe, a second import, inspect's scan of sys.modules.
    assert importlib.util.find_spec("okl_probe").origin == str(probe / "okl_probe" / "__init__.py")
    assert importlib.import_module("okl_probe") is mod
    assert inspect.getmodule(collect.__code__).__file__ == __file__  # a code object: inspect scans every __file__
    assert okl_log.RUNS == []
    assert mod.VALUE == 42 and okl_log.RUNS == [1]  # the real body, once
    assert mod.VALUE == 42 and okl_log.RUNS == [1] and type(mod) is types.ModuleType
    assert type(mod.__spec__.loader).__name__ == "SourceFileLoader" and "okl_probe" not in lazy_imports.deferred()


def test_any_other_importer_imports_eagerly(probe):
    import okl_log
    import okl_other

    assert okl_log.RUNS == [1] and type(okl_other.okl_probe) is types.ModuleType


def test_a_deferred_body_that_fails_says_so_at_its_first_use(probe):
    (probe / "okl_probe" / "__init__.py").write_text("raise OSError('disk gone')\n")
    import okl_importer

    with pytest.raises(ImportError, match=r"okl_probe failed to import at its first use .*disk gone"):
        _ = okl_importer.okl_probe.VALUE
    assert "okl_probe" not in sys.modules  # as a failed eager import leaves it: the next import tries again


def test_finish_runs_every_deferred_body_and_defers_no_more(probe, monkeypatch):
    monkeypatch.setattr(lazy_imports, "_PENDING", {})  # only the probe: wandb stays as it is in this process
    import okl_importer  # noqa: F401
    import okl_log

    assert okl_log.RUNS == []
    lazy_imports.finish()
    assert okl_log.RUNS == [1] and lazy_imports.deferred() == [] and lazy_imports._FINDER not in sys.meta_path


def test_the_switch_turns_deferral_off_and_refuses_other_values(monkeypatch):
    assert lazy_imports.enabled({}) and lazy_imports.enabled({lazy_imports.SWITCH: "1"})
    assert not lazy_imports.enabled({lazy_imports.SWITCH: "0"})
    with pytest.raises(ValueError, match=r"OVERLAPKIT_LAZY_IMPORTS='yes': use 1 .* or 0"):
        lazy_imports.enabled({lazy_imports.SWITCH: "yes"})
    monkeypatch.setenv(lazy_imports.SWITCH, "0")
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not lazy_imports._FINDER])
    assert lazy_imports.install() is False and lazy_imports._FINDER not in sys.meta_path


@pytest.mark.parametrize("preflight_only", [False, True], ids=["trains", "preflight-only"])
def test_a_job_that_trains_imports_the_full_stack_before_it_rebuilds(tmp_path, monkeypatch, preflight_only):
    (tmp_path / "overrides.json").write_text(json.dumps({"set": [], "run": {}}))
    asked = []
    monkeypatch.setattr(stack, "import_bridge", lambda full=False: asked.append(full) or stack._BRIDGE)
    args = entry._args(["--recipe", "llama3_8b_pretrain_8gpu_h100_bf16", "--run-dir", str(tmp_path)]
                       + ["--preflight-only"] * preflight_only)  # fmt: skip
    assert entry.rebuild(args).layout["gpus"] == 8
    assert asked[0] is (not preflight_only)  # first, before anything of ours imports Bridge
