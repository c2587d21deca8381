"""The typed models of the files the project reads (spec/): each refuses what its readers cannot use with the one line
its readers print, strictly (no coercion of '8' or true), and reads what its writer writes."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from overlapkit.spec import dataspec, model, schedule, submission
from overlapkit.spec.profile import MESSAGES, ClusterProfile


def _problem(cls, data, messages, **ctx) -> str:
    with pytest.raises(ValidationError) as exc:
        cls(**data) if dataclasses.is_dataclass(cls) else cls.model_validate(data)
    return model.problem(exc.value, data, messages, **ctx)


def test_a_template_is_found_by_the_errors_place_longest_first():
    toml = {"tokenizer": "t", "blend": [{"prefix": "a", "weight": 1}, {"prefix": 3}]}
    said = _problem(dataspec.DataToml, toml, dataspec.MESSAGES)  # blend.1.prefix → blend.* → the entry's line
    assert said == "blend entry {'prefix': 3}: use prefix = \"<path without .bin/.idx>\" and weight = <number>"
    assert _problem(dataspec.DataToml, {"tokenizer": "t", "blend": []}, dataspec.MESSAGES).startswith("a blend is")
    said = _problem(dataspec.DataToml, {"tokenizer": "t", "blend": [{"prefix": "a", "weight": True}]}, {})
    assert said == "weight True of a: weights must be positive numbers below infinity"  # a validator's own line
    said = _problem(dataspec.DataToml, {"tokenizer": "t", "blends": 1, "blend": [{"prefix": "a"}]}, dataspec.MESSAGES)
    assert said.startswith("unknown key 'blends'; valid: tokenizer, split")


def test_a_profile_is_its_model_strictly_and_a_replace_is_checked_again():
    base = {"name": "x", "account": "a", "partition": "p"}
    assert _problem(ClusterProfile, {**base, "gpus_per_node": "8"}, MESSAGES).startswith("gpus_per_node = '8'")
    assert _problem(ClusterProfile, {**base, "exclusive": 1}, MESSAGES) == "exclusive = 1: expected true or false"
    assert _problem(ClusterProfile, {**base, "acount": "a"}, MESSAGES) == "unknown key 'acount'; did you mean account?"
    profile = ClusterProfile(**base, container_mounts=["/l:/l"])
    assert profile.container_mounts == ("/l:/l",) and profile.env == {}
    with pytest.raises(ValidationError, match="NCCL_X is in both env and secrets"):
        dataclasses.replace(profile, env={"NCCL_X": "1"}, secrets=("NCCL_X",))


def test_a_records_job_ids_are_slurms_shapes_only():
    assert submission.job_id_problem("7_1", "job_id") is None and submission.job_id_problem("7+1", "x") is None
    said = _problem(submission.Submission, {"job_ids": ["7", "-u root"]}, submission.SUBMISSION_MESSAGES)
    assert said.startswith("job_ids is '-u root', not a Slurm job id")
    assert _problem(submission.Submission, {"log": 3}, submission.SUBMISSION_MESSAGES) == "log is 3, not text"
    entry = {"from_iteration": 0, "layout": None}
    said = _problem(submission.LayoutEntry, entry, submission.LAYOUT_MESSAGES, i=2, entry=entry)
    assert said == "entry 2 is {'from_iteration': 0, 'layout': None}, not {from_iteration, layout}"


def test_a_schedule_names_what_it_lacks():
    assert _problem(schedule.Schedule, {"cluster": "local"}, schedule.MESSAGES) == "lacks 'profile'"
