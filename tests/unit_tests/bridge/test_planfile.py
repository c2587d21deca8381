"""The one reader of a run directory's plan.json: a broken file is named field by field (never a KeyError, never
"no plan.json there" for one that is there but wrong), a link is refused as one, and the real one reads. Command-level
cases (make status on a broken plan.json): cluster/test_hostile_records.py."""

from __future__ import annotations

import json

import pytest

from overlapkit import jsonio
from overlapkit.spec import planfile


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda p: p["layout"].update(tp="4"), "layout.tp is '4', not a whole number ≥ 1"),
        (lambda p: p["layout"].update(tp=None), "layout.tp is None, not a whole number ≥ 1"),
        (lambda p: p["layout"].update(tp=True), "layout.tp is True, not a whole number ≥ 1"),
        (lambda p: p["layout"].pop("tp"), "layout.tp is None"),
        (lambda p: p.update(layout=None), "layout is null, not an object"),
        (lambda p: p.update(audit="OK"), "audit is str 'OK', not an object"),
        (lambda p: p["audit"].update(rows=[]), "audit.rows is not an object"),
        (lambda p: p["layout"].update(gpus=0), "layout.gpus is 0, not a whole number ≥ 1"),
        (lambda p: p["layout"].update(dp=0), "layout.dp is 0"),
        (lambda p: p["layout"].update(dp=-4), "layout.dp is -4"),
        (lambda p: p["layout"].update(dp=4), "layout.gpus is 8, not tp×pp×cp×dp = 4"),
        (lambda p: p["layout"].update(vpp="2"), "layout.vpp is '2', not a whole number ≥ 1 (or null)"),
        (lambda p: p.update(recipe="\x1b[2Jllama"), r"recipe is '\x1b[2Jllama', not a recipe's name"),
        (lambda p: p.update(recipe="a\nb"), r"recipe is 'a\nb'"),
        (lambda p: p.update(run=[]), "run is list [], not an object"),
        (lambda p: p["run"].update(checkpoint_dir=5), "run.checkpoint_dir is int 5, not a path"),
        (lambda p: p["run"].update(nsys={"steps": [5]}), "run.nsys is not {steps: [start, end]"),
        (lambda p: p["run"].update(torch_profile={"steps": [5, 3.5]}), "run.torch_profile is not {steps: [start, end]"),
    ],
)
def test_a_broken_plan_json_is_named_field_by_field(tmp_path, write_plan, edit, said):
    plan = write_plan(tmp_path)
    edit(plan)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(jsonio.FileProblem) as exc:
        planfile.read_plan(tmp_path)
    msg = str(exc.value)
    assert said in msg and "\n" not in msg and "\x1b" not in msg
    assert msg.startswith(f"{tmp_path / 'plan.json'}: ") and msg.endswith(planfile.FIX)


def test_a_plan_json_that_is_not_one_is_said_as_what_it_is(tmp_path, write_plan):
    path = tmp_path / "plan.json"
    for text, said in [("{", "is not JSON"), ("", "is empty"), ("[1]", "holds a list, not an object")]:
        path.write_text(text)
        with pytest.raises(jsonio.FileProblem, match=said):
            planfile.read_plan(tmp_path)
    path.unlink()
    with pytest.raises(jsonio.FileProblem, match="plan.json: no such file"):
        planfile.read_plan(tmp_path)
    path.symlink_to("/etc/passwd")
    with pytest.raises(jsonio.FileProblem, match=r"is a symbolic link \(to '/etc/passwd'\)"):
        planfile.read_plan(tmp_path)
    path.unlink()
    write_plan(tmp_path)
    assert planfile.read_plan(tmp_path)["layout"]["gpus"] == 8  # the real one reads
    assert planfile.read_plan(path)["recipe"] == "llama3_8b_pretrain_8gpu_h100_fp8cs"
