"""Files a run leaves on disk, edited or planted by a careless or hostile hand (submission.json, plan.json, the
checkpoint trackers and layout record), and what is written beside them: each read is a typed value or one line
naming the file, the field and the fix (exit 2); a job id read from a file is never handed to Slurm as an option;
no write goes through a planted link. In process (the entry's main, the make variables as the Makefile passes
them); the live-run refusal of `make sbatch` asks the real local Slurm."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from ckpt_fixtures import save_iteration
from slurm_fixtures import held_job

from overlapkit import jsonio, paths
from overlapkit.cluster import chain, resume, runlock, slurm
from overlapkit.errors import BadInput
from overlapkit.spec import runopts


@pytest.fixture
def slurm_calls(monkeypatch):
    """Every argv handed to Slurm's tools (none is run: a job id that reached scancel would cancel for real)."""
    calls = []
    monkeypatch.setattr(slurm, "_run", lambda argv, timeout=30: calls.append(argv))
    return calls


@pytest.fixture
def run_with(tmp_path, write_plan):
    """`run_with(**marker)`: a run directory with the fixture plan.json and a submission.json holding `marker`."""

    def make(**marker):
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
        write_plan(run_dir)
        (run_dir / chain.MARKER).write_text(json.dumps({"state": "submitted", **marker}))
        return run_dir

    return make


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "marker, said",
    [
        ({"job_id": "--user=root"}, "job_id is '--user=root', not a Slurm job id"),
        ({"job_id": "7", "job_ids": ["7", "--me"]}, "job_ids is '--me', not a Slurm job id"),
        ({"job_id": 7}, "job_id is int 7, not a Slurm job id"),
        ({"job_id": ["7"]}, "job_id is list ['7'], not a Slurm job id"),
        ({"job_id": "7", "job_ids": "7"}, "job_ids is '7', not a list"),
        ({"job_id": "7 8"}, "job_id is '7 8', not a Slurm job id"),
        ({"job_id": "7", "log": ["/etc/passwd"]}, "log is ['/etc/passwd'], not text"),  # a plain-sbatch job's log
    ],
)
@pytest.mark.parametrize("action", ["cancel", "status", "logs"])
def test_a_job_id_that_is_not_one_is_refused_before_slurm_hears_of_it(
    tmp_path, make_here, slurm_calls, marker, said, action, run_with
):
    run_dir = run_with(**marker)
    code, out, err = make_here(action, f"RUN={run_dir}")
    assert code == 2 and not out and not slurm_calls
    assert said in _one_line(err) and f"{run_dir / chain.MARKER}: " in err


def test_job_ids_take_only_slurms_shapes():
    for good in ("1", "123456", "12_3", "12+1"):
        assert slurm.checked_id(good) == good
    for bad in ("", "-1", "--me", "1,2", "1_", "abc", " 1", "١٢", None, 1, True):
        with pytest.raises(BadInput):
            slurm.checked_id(bad)
    with pytest.raises(BadInput, match="not a Slurm job id"):
        chain.job_ids({"job_ids": ["7", "-u root"]})


def test_a_submitting_record_with_a_pid_that_is_not_one(tmp_path, make_here):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for pid in ("abc", -3, 1.5, True):
        (run_dir / chain.MARKER).write_text(json.dumps({"state": "submitting", "pid": pid, "host": "x"}))
        code, out, err = make_here("status", f"RUN={run_dir}")
        assert code == 2 and f"pid is {pid!r}, not a process id" in _one_line(err)


def test_make_logs_says_where_the_logs_are_not(tmp_path, make_here, run_with):
    gone = tmp_path / "experiments" / "deleted"
    for where, said in [
        ("/etc", "/etc (from submission.json) is not a nemo_run experiment directory"),
        (str(gone), f"experiment directory {gone} (from submission.json) no longer exists"),
    ]:
        run_dir = run_with(job_id="7", experiment_dir=where)
        code, out, err = make_here("logs", f"RUN={run_dir}")
        assert code == 2 and not out and said in _one_line(err)
    run_dir = run_with(job_id="7")  # a record from before experiment_dir was written
    code, _, err = make_here("logs", f"RUN={run_dir}")
    assert code == 2 and "names no experiment_dir" in _one_line(err)
    gone.mkdir(parents=True)
    (gone / "_CONFIG").write_text("{}")  # nemo_run's, the job not started yet: no logs, said, exit 0
    run_dir = run_with(job_id="7", experiment_dir=str(gone))
    code, out, err = make_here("logs", f"RUN={run_dir}")
    assert code == 0 and out.startswith(f"no logs yet in {gone} (job 7") and not err


def test_make_status_on_a_broken_plan_json_is_one_line(tmp_path, make_here, monkeypatch, run_with):
    monkeypatch.setattr(slurm, "job_state", lambda job: "RUNNING")
    run_dir = run_with(job_id="7", checkpoint_dir=str(tmp_path / "ck"))
    plan = json.loads((run_dir / "plan.json").read_text())
    plan["run"] = "x"
    (run_dir / "plan.json").write_text(json.dumps(plan))
    code, _, err = make_here("status", f"RUN={run_dir}")
    assert code == 2 and "run is str 'x', not an object" in _one_line(err)


# --- the checkpoint directory: trackers, iteration directories, the layout record ---------------------------------

RUN = {"train_iters": 1000}
LAYOUT = {k: 1 for k in resume.LAYOUT_KEYS}


@pytest.mark.parametrize("text", ["-5", "²", "5.0", "abc", "1e3", "\x1b[31m9"])
def test_a_tracker_that_is_not_an_iteration_stops_the_resume(tmp_path, write_plan, text):
    ck = tmp_path / "ck"
    save_iteration(ck, 50)
    (ck / resume.TRACKERS[1]).write_text(text)
    v = resume.guard({**RUN, "checkpoint_dir": str(ck)}, LAYOUT, "RUN_NAME=x")
    [(line, error)] = v.lines
    assert v.code == 1 and error and v.resume is None  # never "resuming from iteration 50"
    assert f"holds {text!r}, not an iteration number" in line and "\n" not in line
    write_plan(tmp_path)
    last = chain.status_lines(tmp_path, {"job_id": "7", "checkpoint_dir": str(ck)})[-1]  # status says it too
    assert last.startswith(f"checkpoints: {ck}: ") and last.endswith("a resume stops on it")


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_planted_tracker_stops_the_resume_in_one_line_never_read(tmp_path, write_plan, kind, within):
    ck = tmp_path / "ck"
    save_iteration(ck, 50)
    tracker = ck / resume.TRACKERS[1]
    tracker.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(tracker)  # no writer: a blocking open waits forever
    elif kind == "device":
        tracker.symlink_to("/dev/zero")  # endless
    else:
        tracker.write_text("5" * (resume.TRACKER_LIMIT + 1))
    with within(20):
        v = resume.guard({**RUN, "checkpoint_dir": str(ck)}, LAYOUT, "RUN_NAME=x")
    [(line, error)] = v.lines
    assert v.code == 1 and error and v.resume is None and f"{tracker}: " in line and "\n" not in line
    assert ("is larger than" if kind == "huge" else "is not a regular file") in line


def test_an_iteration_directory_that_is_not_one_is_not_an_iteration(tmp_path):
    ck = tmp_path / "ck"
    save_iteration(ck, 50)
    (ck / "iter_²").mkdir()
    (ck / "iter_-5").mkdir()
    assert resume.state(str(ck)).missing == {50: ()}  # the one iteration, complete
    assert resume.guard({**RUN, "checkpoint_dir": str(ck)}, LAYOUT, "w").resume == 50


@pytest.mark.parametrize(
    "record, said",
    [
        ([1, 2], "entry 0 is 1, not {from_iteration, layout}"),
        ([{"from_iteration": "abc", "layout": LAYOUT}], "entry 0's from_iteration is 'abc', not an iteration"),
        ([{"from_iteration": -1, "layout": LAYOUT}], "from_iteration is -1"),
        ([{"from_iteration": 0, "layout": None}], "entry 0 is {'from_iteration': 0, 'layout': None}"),
        ({"a": 1}, "holds an object, not a list"),
    ],
)
def test_a_broken_layout_record_stops_the_resume_in_one_line(tmp_path, record, said):
    ck = tmp_path / "ck"
    save_iteration(ck, 50)
    (ck / resume.LAYOUTS).write_text(json.dumps(record))
    v = resume.guard({**RUN, "checkpoint_dir": str(ck)}, LAYOUT, "RUN_NAME=x")
    assert v.code == 1 and said in v.lines[-1][0] and resume.LAYOUTS in v.lines[-1][0]


def test_a_checkpoint_path_that_is_no_directory(tmp_path):
    afile, loop = tmp_path / "ck-file", tmp_path / "loop"
    afile.write_text("not a checkpoint")
    loop.symlink_to(loop)
    assert runopts.directory_problem(str(afile)) == f"{afile} is a file, not a directory"
    assert "Too many levels of symbolic links" in runopts.directory_problem(str(loop / "ck"))
    assert runopts.directory_problem(str(tmp_path / "new")) is None and runopts.directory_problem(str(tmp_path)) is None
    for where in (afile, loop / "ck"):
        v = resume.guard({**RUN, "checkpoint_dir": str(where)}, LAYOUT, "RUN_NAME=x")
        assert v.code == 1 and "use another RUN_NAME" in v.lines[0][0]


# --- writes never follow a planted link ----------------------------------------------------------------------------


def test_writes_go_through_no_planted_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "submission.json.tmp").symlink_to(target)  # the fixed temp name the writer once used
    (run_dir / "plan.json").symlink_to(target)  # the final name itself
    jsonio.write_json(run_dir / "submission.json", {"state": "dryrun"})
    jsonio.write_json(run_dir / "plan.json", {"recipe": "x"})
    assert target.read_text() == "keep"
    assert not (run_dir / "plan.json").is_symlink() and json.loads((run_dir / "plan.json").read_text()) == {
        "recipe": "x"
    }
    assert json.loads((run_dir / "submission.json").read_text()) == {"state": "dryrun"}
    assert sorted(p.name for p in run_dir.iterdir()) == ["plan.json", "submission.json", "submission.json.tmp"]


def test_written_files_keep_the_umask(tmp_path):
    modes = []
    for mask in (0o077, 0o002):
        old = os.umask(mask)
        try:
            modes.append(jsonio.write_text(tmp_path / "a", "x").stat().st_mode & 0o777)
        finally:
            os.umask(old)
    assert modes == [0o600, 0o664]  # as open() leaves a new file: 0o666 less the umask


# --- make sbatch while the run is live (the real local Slurm) ------------------------------------------------------


@pytest.mark.slurm
def test_make_sbatch_is_refused_while_its_run_name_is_live(make_here):
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    ck = paths.runs_root() / "slurm" / "checkpoints" / name  # the local profile's job_dir, runs/slurm
    held = held_job()
    try:
        runlock.record(ck, ck.parent / "run", [held])
        code, out, err = make_here("sbatch", "RECIPE=llama3_8b_pretrain_8gpu_h100_bf16", f"RUN_NAME={name}")
        assert code == 2 and not out
        assert f"RUN_NAME={name} is live in {ck} (job {held} PENDING" in _one_line(err) and "nothing written" in err
    finally:
        subprocess.run(["scancel", held], check=False)
        for f in ck.iterdir():
            f.unlink()
        ck.rmdir()


def test_the_job_cancels_no_later_segment_from_an_edited_record(tmp_path, slurm_calls):
    (tmp_path / chain.MARKER).write_text(json.dumps({"job_id": "7", "job_ids": ["7", "--me"]}))
    [line] = chain.cancel_after(tmp_path, 1)
    assert line.startswith("later segments not cancelled: ") and "--me" in line and not slurm_calls


def test_an_edited_run_record_names_itself_and_reaches_no_squeue(tmp_path, slurm_calls):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / runlock.RECORD).write_text(json.dumps([{"run_dir": "r", "job_ids": ["7", "--me"]}, "junk", {"job_ids": 3}]))
    with pytest.raises(BadInput, match=f"{ck / runlock.RECORD}: a job id is '--me', not a Slurm job id") as exc:
        runlock.live_problem(ck, "x")
    assert "\n" not in str(exc.value) and not slurm_calls


# --- the plain-sbatch path: a job of `make sbatch`'s script records itself where make submit records its jobs ------


@pytest.fixture
def plain_run(tmp_path, write_plan, monkeypatch):
    """`plain_run(live)`: a run directory as `make sbatch RUN_NAME=plain` leaves it (plan.json, overrides.json, an
    sbatch-script record), its checkpoint directory, and Slurm saying that the job ids in `live` are running."""
    run_dir, ck = tmp_path / "runs" / "r", tmp_path / "checkpoints" / "plain"
    run_dir.mkdir(parents=True)
    write_plan(run_dir)
    opts = runopts.RunOptions(run_name="plain", job_dir=str(tmp_path))
    (run_dir / "overrides.json").write_text(json.dumps({"run": opts.to_dict()}))
    script = {"script": str(run_dir / "sbatch.sh"), "cluster": "local", "preflight_only": True}
    (run_dir / chain.MARKER).write_text(json.dumps({"state": "sbatch-script", **script, "checkpoint_dir": str(ck)}))

    def start(live=()):
        monkeypatch.setattr(slurm, "live_jobs", lambda ids: [(j, "RUNNING") for j in ids if j in live])
        monkeypatch.setattr(slurm, "job_state", lambda job: "RUNNING" if job in live else "COMPLETED")
        return run_dir, ck

    return start


def _claim(run_dir, job, monkeypatch, capsys):
    from launch import entry

    monkeypatch.setenv("SLURM_JOB_ID", job)
    code = entry.main(["--recipe", "r", "--run-dir", str(run_dir), "--preflight-only", "--claim"])
    return (code, *capsys.readouterr())


def test_a_plain_sbatch_job_is_recorded_where_make_submit_records_its_jobs(plain_run, make_here, monkeypatch, capsys):
    """The job's first step (launch/entry.py --claim) puts its id in submission.json and overlapkit-runs.json: make
    status/logs/cancel RUN= find it, and make submit/sbatch on its RUN_NAME are refused while it is live."""
    run_dir, ck = plain_run(live={"41"})
    code, out, err = make_here("status", f"RUN={run_dir}")
    assert code == 0 and f"a plain sbatch script (sbatch {run_dir / 'sbatch.sh'}): no job of it has started yet" in out
    assert _claim(run_dir, "41", monkeypatch, capsys) == (
        0,
        f"job 41: recorded in {run_dir / chain.MARKER} (make status|logs|cancel RUN={run_dir})\n",
        "",
    )
    info = json.loads((run_dir / chain.MARKER).read_text())
    assert info["state"] == "submitted" and info["job_ids"] == ["41"] and info["preflight_only"] is True
    assert [s["job_ids"] for s in runlock.submissions(ck)] == [["41"]]
    code, out, _ = make_here("status", f"RUN={run_dir}")
    assert code == 0 and "job 41 RUNNING" in out
    (run_dir / "slurm-41.out").write_text("preflight: OK (8/8 ranks)\n")  # the script's --output
    code, out, _ = make_here("logs", f"RUN={run_dir}")
    assert code == 0 and "preflight: OK (8/8 ranks)" in out
    problem = runlock.live_problem(ck, "plain")  # what make submit and make sbatch ask first
    assert problem.startswith(f"RUN_NAME=plain is live in {ck} (job 41 RUNNING, run {run_dir})")


def test_a_second_job_of_the_script_stops_before_training_while_the_first_is_live(plain_run, monkeypatch, capsys):
    run_dir, ck = plain_run(live={"41", "42"})
    assert _claim(run_dir, "41", monkeypatch, capsys)[0] == 0
    code, out, err = _claim(run_dir, "42", monkeypatch, capsys)  # sbatch typed twice, or while make submit's runs
    assert code == 2 and not out and "job 42 stops before training" in _one_line(err)
    assert f"RUN_NAME=plain is live in {ck} (job 41 RUNNING" in err
    assert json.loads((run_dir / chain.MARKER).read_text())["job_ids"] == ["41"]  # the live job's record kept
    assert _claim(run_dir, "41", monkeypatch, capsys)[0] == 0  # Slurm requeued the first: it is no second run
    code, _, err = _claim(run_dir, "--me", monkeypatch, capsys)
    assert code == 2 and "SLURM_JOB_ID (this job's id) is '--me', not a Slurm job id" in _one_line(err)
    assert [s["job_ids"] for s in runlock.submissions(ck)] == [["41"], ["41"]]


def _sbatch_and_wait(script) -> tuple[str, str]:
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout
    return job.strip(), slurm.wait_for(job.strip(), timeout=300, poll=1)


@pytest.mark.slurm
def test_a_job_of_make_sbatchs_script_records_itself_or_stops_on_the_real_slurm(make_here, tmp_path):
    """`make sbatch RUN_NAME=` then `sbatch <script>` by hand: the job's first step records it (make status and logs
    RUN= find it, overlapkit-runs.json holds it); sbatch'd again while another run is live there, the job stops in
    that step, before any rank trains."""
    profile = tmp_path / "mine.toml"
    text = (paths.REPO_ROOT / "slurm" / "profiles" / "local.toml").read_text()
    profile.write_text(text.replace('job_dir = "runs/slurm"', f'job_dir = "{tmp_path / "jobs"}"'))
    args = ("RECIPE=llama3_8b_pretrain_8gpu_h100_bf16", f"CLUSTER={profile}", "RUN_NAME=plain", "PREFLIGHT=env")
    code, out, err = make_here("sbatch", *args)
    assert code == 0, err
    (run_dir,) = (tmp_path / "jobs" / "runs").iterdir()
    ck = tmp_path / "jobs" / "checkpoints" / "plain"
    job, state = _sbatch_and_wait(run_dir / "sbatch.sh")
    assert state == "COMPLETED", (run_dir / f"slurm-{job}.out").read_text()
    assert [s["job_ids"] for s in runlock.submissions(ck)] == [[job]]
    code, out, _ = make_here("status", f"RUN={run_dir}")  # one line per job, as docs/pretraining.md shows
    assert code == 0 and out.splitlines()[1] == f"  job {job} COMPLETED; preflight OK (8/8 ranks)", out
    code, out, _ = make_here("status", f"RUN={run_dir}", "FORMAT=json")  # the record itself, for scripts
    [record] = json.loads(out)["jobs"]
    assert code == 0 and record["job_id"] == job and record["preflight"] == {"ok": True, "ranks": [8, 8], "error": None}
    code, out, _ = make_here("logs", f"RUN={run_dir}")
    assert code == 0 and f"job {job}: recorded in {run_dir / chain.MARKER}" in out and "preflight: OK (8/8" in out
    held = held_job()
    try:
        runlock.record(ck, tmp_path / "other-run", [held])
        second, state = _sbatch_and_wait(run_dir / "sbatch.sh")
    finally:
        subprocess.run(["scancel", held], check=False)
    log = (run_dir / f"slurm-{second}.out").read_text()
    assert state == "FAILED" and f"error: RUN_NAME=plain is live in {ck} (job {held} PENDING" in log
    assert f"job {second} stops before training" in log and "preflight" not in log
    assert json.loads((run_dir / chain.MARKER).read_text())["job_id"] == job


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda p: p["layout"].update(tp="4"), "layout.tp is '4', not a whole number ≥ 1"),
        (lambda p: p.update(audit="OK"), "audit is str 'OK', not an object"),
        (lambda p: p.update(run={"checkpoint_dir": 5}), "run.checkpoint_dir is int 5, not a path"),
    ],
)
def test_the_in_job_entry_reads_plan_json_through_planfile(tmp_path, write_plan, capsys, edit, said):
    """Every rank's first read (launch/entry.py): a broken plan.json is one line in the job's log, exit 2, before
    any check or training (it was a KeyError's traceback, once per rank)."""
    from launch import entry

    plan = write_plan(tmp_path)
    edit(plan)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code = entry.main(["--recipe", "r", "--run-dir", str(tmp_path), "--preflight-only"])
    out, err = capsys.readouterr()
    assert code == 2 and not out and said in _one_line(err) and err.startswith(f"error: {tmp_path / 'plan.json'}: ")
    assert not (tmp_path / "preflight").exists()


def test_a_plain_sbatch_job_without_run_name_records_itself_and_takes_no_lock(
    tmp_path, write_plan, monkeypatch, capsys
):
    """A benchmark (no RUN_NAME) saves no checkpoints: its job is recorded for make status/logs/cancel, and no
    checkpoint directory, lock or run record is made for it."""
    write_plan(tmp_path)
    (tmp_path / "overrides.json").write_text(json.dumps({"run": runopts.RunOptions(job_dir=str(tmp_path)).to_dict()}))
    (tmp_path / chain.MARKER).write_text(json.dumps({"state": "sbatch-script", "script": str(tmp_path / "sbatch.sh")}))
    assert _claim(tmp_path, "9", monkeypatch, capsys)[0] == 0
    info = json.loads((tmp_path / chain.MARKER).read_text())
    assert (info["state"], info["job_id"], info["script"]) == ("submitted", "9", str(tmp_path / "sbatch.sh"))
    assert not (tmp_path / "checkpoints").exists()
