"""The nightly's make variables answered as every other target answers them: GPU= refused (an unknown GPU, or one
the goldens were not measured on) before anything is planned; DRYRUN=1 on nightly-schedule queues and writes nothing
(it once queued a real scheduler job); a yes/no word that is neither refused. In process; the dry run asks the real
local Slurm (its partition check) and then its queue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlapkit.cluster import slurm
from overlapkit.nightly import calibrate, schedule
from overlapkit.spec import planfile


@pytest.mark.parametrize(
    "target, gpu, said",
    [
        ("nightly", "a100", "GPU=a100: not a GPU the models know"),
        ("nightly", "h200", "GPU=h200: the nightly runs each recipe on the GPU its goldens were measured on (h100)"),
        ("nightly-schedule", "a100", "GPU=a100: not a GPU the models know"),
    ],
)
def test_gpu_on_the_nightly_is_refused_in_one_line(tmp_path, make_here, target, gpu, said):
    code, out, err = make_here(target, f"GPU={gpu}", f"JOB_DIR={tmp_path}", "AT=02:00")
    assert code == 2 and not out and err.count("\n") == 1 and said in err
    assert not any(tmp_path.iterdir())


def test_a_dryrun_word_that_is_neither_is_refused(tmp_path, make_here):
    code, _, err = make_here("nightly-schedule", "DRYRUN=sure", f"JOB_DIR={tmp_path}", "AT=02:00")
    assert code == 2 and err.count("\n") == 1 and "argument --dryrun: 'sure' is neither on" in err


@pytest.mark.slurm
def test_nightly_schedule_dryrun_queues_and_writes_nothing(tmp_path, make_here):
    before = schedule.slurm.queued(schedule.SCHEDULER_NAME)
    code, out, err = make_here("nightly-schedule", "DRYRUN=1", f"JOB_DIR={tmp_path}", "AT=now+90")
    assert code == 0 and not err, err
    first, last = out.splitlines()
    assert first.startswith(f"dry run: would queue {schedule.SCHEDULER_NAME} on partition local, held until ")
    assert last == "dry run: nothing queued, nothing written"
    assert schedule.slurm.queued(schedule.SCHEDULER_NAME) == before and not any(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("target", ["nightly", "nightly-status", "nightly-report", "nightly-unschedule"])
def test_a_job_dir_that_is_a_file_is_named(tmp_path, make_here, target):
    afile = tmp_path / "jobs"
    afile.write_text("")
    code, out, err = make_here(target, f"JOB_DIR={afile}")
    assert code == 2 and not out and err.count("\n") == 1
    assert f"JOB_DIR: job_dir: {afile} is a file, not a directory" in err and "Errno" not in err


@pytest.mark.parametrize("text, said", [("[1, 2]", "holds a list, not an object"), ("{", "is not JSON")])
def test_a_schedule_record_that_is_not_one_is_named(tmp_path, make_here, text, said):
    (tmp_path / "nightly").mkdir()
    (tmp_path / "nightly" / schedule.SCHEDULE_FILE).write_text(text)
    for target in ("nightly-status", "nightly-unschedule"):
        code, out, err = make_here(target, f"JOB_DIR={tmp_path}")
        assert code == 2 and not out and err.count("\n") == 1 and said in err and schedule.SCHEDULE_FILE in err


# --- a run's plan.json, read back by the nightly's report, bless, the overlap report, calibrate: planfile alone ---

BROKEN_PLANS = [
    (lambda p: p["layout"].update(tp="4"), "layout.tp is '4', not a whole number ≥ 1"),
    (lambda p: p.update(layout=None), "layout is null, not an object"),
    (lambda p: p.update(audit="OK"), "audit is str 'OK', not an object"),
    (lambda p: p.update(recipe="\x1b[2Jr"), r"recipe is '\x1b[2Jr', not a recipe's name"),
    ("link", "is a symbolic link (to "),
]


def _broken_run(tmp_path, write_plan, edit) -> Path:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    plan = write_plan(run_dir)
    if edit == "link":  # a whole plan, elsewhere: make plan writes a file, so a link is no plan of this run
        (tmp_path / "elsewhere.json").write_text(json.dumps(plan))
        (run_dir / "plan.json").unlink()
        (run_dir / "plan.json").symlink_to(tmp_path / "elsewhere.json")
    else:
        edit(plan)
        (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "train.log").write_text("")
    record = {"state": "submitted", "job_id": "7", "log": str(run_dir / "train.log"), "run_dir": str(run_dir)}
    (run_dir / "submission.json").write_text(json.dumps(record))
    return run_dir


def _named(err: str, run_dir: Path, said: str) -> None:
    assert err.count("\n") == 1 and err.startswith(f"error: {run_dir / 'plan.json'}: ") and said in err, err
    assert "\x1b" not in err and "Traceback" not in err and planfile.FIX in err


@pytest.mark.parametrize("edit, said", BROKEN_PLANS)
def test_a_broken_plan_json_is_one_line_for_every_reader_of_a_run(
    tmp_path, make_here, write_plan, monkeypatch, edit, said
):
    """make nightly-report, make bless, make overlap-report RUN= and make calibrate read a run's plan.json through
    planfile (the in-job entry: cluster/test_hostile_records.py), each naming the file and the field."""
    run_dir = _broken_run(tmp_path, write_plan, edit)
    (run_dir / "nsys").mkdir()
    before = sorted(p.name for p in run_dir.iterdir())
    code, out, err = make_here("overlap-report", f"RUN={run_dir}")
    assert code == 2 and not out and sorted(p.name for p in run_dir.iterdir()) == before
    _named(err, run_dir, said)
    monkeypatch.setattr(slurm, "job_state", lambda job: "COMPLETED")
    night = tmp_path / "nightly" / "20261201-020000"
    night.mkdir(parents=True)
    entry = {"recipe": "r", "nodes": 1, "dp": 8, "run_dir": str(run_dir), "job_id": "7"}
    (night / "night.json").write_text(
        json.dumps({"job_dir": str(tmp_path), "preflight_only": False, "entries": [entry]})
    )
    code, out, err = make_here("nightly-report", f"NIGHT={night}")
    assert code == 2 and not out
    _named(err, run_dir, said)
    assert sorted(p.name for p in night.iterdir()) == ["night.json"]  # no report of a night it could not read
    code, out, err = make_here("bless", f"RUN={run_dir}")
    assert code == 2 and not out
    _named(err, run_dir, said)
    # make calibrate: this run skipped with its line, the rest count
    skipped = calibrate.read_run(run_dir, "local")
    _named(f"error: {skipped}\n", run_dir, said)


def test_the_schedule_lock_is_never_opened_through_a_planted_link(tmp_path, make_here):
    (tmp_path / "nightly").mkdir()
    lock = tmp_path / "nightly" / f"{schedule.SCHEDULE_FILE}.lock"
    lock.symlink_to(tmp_path / "elsewhere")  # opened for append, the link's target was created
    code, out, err = make_here("nightly-unschedule", f"JOB_DIR={tmp_path}")
    assert code == 2 and not out and err.count("\n") == 1
    assert f"{lock} is a symbolic link to {tmp_path / 'elsewhere'}, never followed" in err
    assert not (tmp_path / "elsewhere").exists()
