"""The nightly's make variables answered as every other target answers them: GPU= refused (an unknown GPU, or one
the goldens were not measured on) before anything is planned; DRYRUN=1 on nightly-schedule queues and writes nothing
(it once queued a real scheduler job); a yes/no word that is neither refused. In process; the dry run asks the real
local Slurm (its partition check) and then its queue."""

from __future__ import annotations

import pytest

from overlapkit.regress import schedule


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
