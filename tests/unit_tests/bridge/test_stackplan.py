"""One stack's plan records (overlapkit/bridge/stackplan.py), on the pinned stack in this process: the record is what
`make plan FORMAT=json` prints plus every resolved config field, the fields of Bridge's own recipe function, and
the attributes a recipe sets that are no field; a recipe that fails to plan is its first error in one line."""

from __future__ import annotations

import enum
import importlib
import json

import pytest

from overlapkit.bridge import registry, stack, stackplan

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


@pytest.fixture(scope="module")
def rec():
    stack.import_bridge()
    return stackplan.record(R8)


def test_a_record_is_the_plans_own_json_plus_its_resolved_fields(rec):
    from overlapkit.bridge.build import make_plan

    plan = make_plan(R8, caller_env={})
    same = {k: v for k, v in rec.items() if k not in ("config", "not_fields", "bridge_config")}
    assert json.loads(json.dumps(same)) == json.loads(json.dumps(plan.to_dict()))
    cfg = rec["config"]
    assert cfg["model.tensor_model_parallel_size"] == plan.layout["tp"]
    assert cfg["train.global_batch_size"] == plan.layout["gbs"]
    assert cfg["ddp.overlap_grad_reduce"] is plan.resolved.ddp.overlap_grad_reduce
    # Bridge's CommOverlapConfig keeps the user's settings in an attribute of its own (its __post_init__); nothing
    # else is set outside the fields. The diff reports only what the candidate adds to this.
    assert list(rec["not_fields"]) == ["comm_overlap.user_comm_overlap_cfg"]


def test_the_bridge_recipe_functions_own_fields_are_recorded_before_the_recipe_tunes_them(rec):
    module, _, func = rec["source"].rpartition(".")
    own = getattr(importlib.import_module(module), func)()
    fields = rec["bridge_config"]["fields"]
    assert fields["train.global_batch_size"] == own.train.global_batch_size
    assert fields["model.seq_length"] == own.model.seq_length
    assert stackplan.bridge_fields("NeMo 24.07 performance_summary.md") is None  # a recipe built on no function


def test_an_attribute_a_fork_sets_that_is_no_field_is_named():
    stack.import_bridge()
    cfg = registry.get(R8).build()
    cfg.model.cuda_graph_scopes = "full_iteration"  # a near miss of a real field: Python takes it without a word
    fields, missing = {}, {}
    stackplan.flatten(cfg.model, "model.", fields, missing)
    assert "model.cuda_graph_scope" in fields and "model.cuda_graph_scopes" not in fields
    assert missing == {"model.cuda_graph_scopes": f"set on {type(cfg.model).__name__}, which has no such field"}


def test_a_recipe_that_fails_to_plan_is_its_first_error_in_one_line():
    err = stackplan.record("no_such_recipe_pretrain_8gpu_h100_bf16")["error"]
    assert err.startswith("UnknownRecipe: ") and "\n" not in err


class Color(enum.Enum):
    RED = 1


def test_values_are_the_same_in_every_process():
    import torch

    assert stackplan.value_of(torch.bfloat16) == "torch.bfloat16"
    assert stackplan.value_of(Color.RED) == "Color.RED"
    assert stackplan.value_of(len) == "builtins.len"
    assert stackplan.value_of((1, [2.5, None])) == [1, [2.5, None]]
    assert stackplan.value_of(object()) == "<object object>"  # its address dropped
