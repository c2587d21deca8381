"""The stack diff (overlapkit/nightly/stackdiff.py): records in, differences out, and the real report of
`make stack-diff STACK="megatron-bridge==0.6.0 megatron-core==0.19.0"` (tests/data/stackdiff/report-0.6.0, run on this
machine against PyPI) checked against what the two releases' own code says: 0.6.0's source read from the excerpts of
its wheel (tests/data/stackdiff/megatron-bridge-0.6.0, Apache-2.0, LICENSE beside them), 0.6.2's from the installed
package, both by `ast`, never through the diff's code."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import types
from pathlib import Path

import pytest

from overlapkit.nightly import night_report, stackdiff
from tests.unit_tests.conftest import PLAN_FIXTURE

DATA = Path(__file__).parents[2] / "data" / "stackdiff"
OLD = DATA / "megatron-bridge-0.6.0"  # verbatim excerpts of 0.6.0's wheel
REPORT = json.loads((DATA / "report-0.6.0" / "stackdiff.json").read_text())
FIELD = "optimizer.overlap_param_gather_with_optimizer_step"
ENABLE = "_enable_overlap_param_gather_with_optimizer_step"


def _set(rec):
    return {"versions": {"megatron-bridge": "x"}, "records": [rec]}


@pytest.fixture
def rec() -> dict:
    """A real plan record (make submit's plan.json), with a few resolved fields as the planner adds them."""
    r = json.loads(PLAN_FIXTURE.read_text())
    r["config"] = {"model.cuda_graph_scope": "full", "train.global_batch_size": 128, "ddp.bucket_size": 1}
    return r


def test_a_stack_against_itself_is_unchanged_and_exits_0(rec):
    d = stackdiff.diff(_set(rec), _set(copy.deepcopy(rec)))
    assert [r["verdict"] for r in d["recipes"]] == ["unchanged"]
    assert stackdiff.exit_status(d) == 0
    assert stackdiff.render(d).splitlines()[-1] == "1 recipes: 1 unchanged"


def test_each_kind_of_difference_is_reported_with_both_sides(rec):
    cand = copy.deepcopy(rec)
    row = next(iter(cand["audit"]["rows"]))
    cand["audit"]["rows"][row] = {"state": "flipped", "detail": "the candidate's reason"}
    var = cand["env"]["env"][0]
    var["value"], var["layer"] = "99", "cluster"
    cand["config"]["train.global_batch_size"] = 256
    del cand["config"]["model.cuda_graph_scope"]
    cand["config"]["model.cuda_graph_scopes"] = ["attn"]  # a rename: the nearest new field is named
    cand["audit"]["errors"].append({"level": "error", "code": "new_rule", "message": "breaks", "fix": None})
    cand["audit"]["ok"] = False
    cand["memory"]["total_gb"] += 1.5
    d = stackdiff.diff(_set(rec), _set(cand))
    r = d["recipes"][0]
    assert r["verdict"] == "changed" and stackdiff.exit_status(d) == 1  # the candidate's audit fails
    assert r["overlaps"][0]["row"] == row and r["overlaps"][0]["candidate"]["detail"] == "the candidate's reason"
    assert r["env"][0] == {
        "name": var["name"],
        "change": "changed",
        "pinned": {"value": rec["env"]["env"][0]["value"], "layer": rec["env"]["env"][0]["layer"]},
        "candidate": {"value": "99", "layer": "cluster"},
    }
    assert r["config"]["changed"] == [{"field": "train.global_batch_size", "pinned": 128, "candidate": 256}]
    assert r["config"]["gone"] == [
        {"field": "model.cuda_graph_scope", "pinned": "full", "nearest": "model.cuda_graph_scopes"}
    ]
    assert r["audit"]["new"] == [{"level": "error", "code": "new_rule", "message": "breaks"}]
    assert r["sizing"]["memory_gb"]["delta"] == 1.5
    text = "\n".join(stackdiff.recipe_lines(r))
    assert "config model.cuda_graph_scope ('full') no longer exists; nearest new field: model.cuda_graph_scopes" in text
    assert f"env {var['name']} changed: " in text and "-> 99 [cluster]" in text


def test_a_recipe_that_fails_under_the_candidate_is_its_first_error_and_exits_1(rec):
    d = stackdiff.diff(_set(rec), _set({"recipe": rec["recipe"], "error": "RuntimeError: boom"}))
    assert stackdiff.recipe_lines(d["recipes"][0]) == [
        f"{rec['recipe']}: fails to plan under the candidate stack: RuntimeError: boom"
    ]
    assert stackdiff.exit_status(d) == 1


def test_the_night_report_shows_the_candidates_diff_beside_the_runs(tmp_path):
    (tmp_path / stackdiff.NIGHT_FILE).write_text(json.dumps(REPORT))
    night = {"stamp": "20261204-020000", "cluster": "local", "preflight_only": True}
    md = night_report.render(night, [], {}, tmp_path)
    assert f"## Candidate stack `{REPORT['stack']}`: what it changes in each plan" in md
    assert (
        "| qwen3_30b_a3b_pretrain_16gpu_h100_bf16 | not run tonight | qwen3_30b_a3b_pretrain_16gpu_h100_bf16: fails"
        in md
    )
    assert "Candidate stack" not in night_report.render(night, [], {}, tmp_path / "no-stack-tonight")


# --- the real 0.6.0 report against the two releases' code ----------------------------------------------------------


def _functions(path_or_source) -> dict[str, ast.FunctionDef]:
    src = path_or_source.read_text() if isinstance(path_or_source, Path) else path_or_source
    return {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _reaches(functions: dict[str, ast.FunctionDef], name: str) -> bool:
    """Does function `name` call the helper, itself or through the functions of the excerpt it calls?"""
    calls = _calls(functions[name])
    return ENABLE in calls or any(_reaches(functions, c) for c in calls if c in functions and c != name)


def _old_recipe_functions() -> dict[str, ast.FunctionDef]:
    out = {}
    for name in ("llama3", "llama31"):
        out |= _functions(OLD / f"perf_recipes__llama__h100__{name}.py.txt")
    return out


def test_the_report_is_of_the_two_stacks_it_names():
    assert REPORT["pinned"]["megatron-bridge"] == "0.6.2" and REPORT["candidate"]["megatron-bridge"] == "0.6.0"
    assert REPORT["pinned"]["megatron-core"] == "0.19.2" and REPORT["candidate"]["megatron-core"] == "0.19.0"
    assert len(REPORT["recipes"]) == 18


def test_bridge_0_6_0s_recipe_functions_turn_on_param_gather_with_the_optimizer_step_as_reported():
    """0.6.0's llama3/llama31 perf recipes call a helper that sets the field True; 0.6.2 took it out (the issue's
    Megatron-Bridge #5847). The report says so for exactly the recipes built on those functions, and that the
    recipe sets the field itself (its overlap stack keeps it off: the plan is unchanged)."""
    helper = _functions(OLD / "perf_recipes___common.py.txt")[ENABLE]
    sets = {ast.unparse(t) for n in ast.walk(helper) if isinstance(n, ast.Assign) for t in n.targets}
    assert "cfg.optimizer.overlap_param_gather_with_optimizer_step" in sets
    common = importlib.import_module("megatron.bridge.perf_recipes._common")
    assert not hasattr(common, ENABLE)  # 0.6.2 has no such helper
    old = _old_recipe_functions()
    checked = 0
    for r in REPORT["recipes"]:
        module, _, func = (r["source"] or "").rpartition(".")
        if func not in old:
            continue
        new_src = inspect.getsource(getattr(importlib.import_module(module), func))
        assert ENABLE not in new_src
        turned_on = _reaches(old, func)
        reported = {c["field"]: c for c in r["bridge_recipe"]}
        assert (FIELD in reported) == turned_on, func
        if turned_on:
            assert (reported[FIELD]["pinned"], reported[FIELD]["candidate"], reported[FIELD]["reaches"]) == (
                False,
                True,
                False,
            )
            assert r["verdict"] == "unchanged"  # the recipe's overlap stack sets it off under both
        checked += 1
    assert checked == 8  # the llama3 8B/70B and llama3.1 405B recipes, both dtypes
    assert (
        sum(
            FIELD in {c["field"] for c in r["bridge_recipe"]}
            for r in REPORT["recipes"]
            if r["verdict"] != "fails to plan"
        )
        >= 4
    )


def test_bridge_0_6_0_asks_the_gpu_for_every_moe_flex_config_so_its_moe_recipes_fail_to_plan_on_a_cpu():
    """0.6.0's apply_flex_dispatcher_backend asks torch.cuda for the device before anything else; 0.6.2 returns
    first when there is no CUDA (and added a third backend, ncclep). The report's failures are exactly there."""
    old_src = (OLD / "training__flex_dispatcher_backend.py.txt").read_text()
    old_fn = _functions(old_src)["apply_flex_dispatcher_backend"]
    assert "is_available" not in ast.unparse(old_fn)
    from megatron.bridge.training import flex_dispatcher_backend as new

    assert "torch.cuda.is_available()" in inspect.getsource(new.apply_flex_dispatcher_backend)
    cfg = types.SimpleNamespace(
        num_moe_experts=128, moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True
    )
    new.apply_flex_dispatcher_backend(cfg, "hybridep")  # 0.6.2 on this CPU: no GPU asked
    assert cfg.moe_token_dispatcher_type == "flex"
    failed = [r for r in REPORT["recipes"] if r["verdict"] == "fails to plan"]
    assert failed and all(r["side"] == "candidate" for r in failed)
    lines = old_src.splitlines()
    for r in failed:
        where = r["error"].rsplit("(at megatron/bridge/training/flex_dispatcher_backend.py:", 1)[1]
        line, _, func = where.rstrip(")").partition(" in ")
        assert func == "apply_flex_dispatcher_backend"
        assert lines[int(line) - 1].strip() == "device_properties = torch.cuda.get_device_properties(0)"
        assert r["error"].startswith("RuntimeError: Found no NVIDIA driver")
        assert r["layout"]["experts"] > 0  # a MoE recipe
    dense = [r for r in REPORT["recipes"] if not (r["layout"] or {}).get("experts")]
    assert dense and all(r["verdict"] == "unchanged" for r in dense)
