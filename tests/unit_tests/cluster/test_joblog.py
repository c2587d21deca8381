"""A failed job's first error line (cluster/joblog.py): what counts as one, in which file, read guarded (a FIFO,
socket or device among the logs is skipped with its reason, never a hang), shown as one printable line. In process
on real log text (a Python traceback as CPython prints it, Slurm's own lines); `make status` and the nightly report
on a job that really fails on the local Slurm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from overlapkit import jsonio
from overlapkit.cluster import chain, joblog, slurm

# What rank 0 printed when Bridge's pretrain.py could not import nvidia_resiliency_ext (issue 40: a real local submit).
TRACEBACK = """preflight: OK (8/8 ranks)
/x/megatron/core/utils.py:12: UserWarning: Transformer Engine is not installed
Traceback (most recent call last):
  File "/x/launch/entry.py", line 183, in <module>
    sys.exit(main())
  File "/x/megatron/bridge/training/pretrain.py", line 19, in <module>
    from nvidia_resiliency_ext.inprocess import CallWrapper
ModuleNotFoundError: No module named 'nvidia_resiliency_ext'

During handling of the above exception, another exception occurred:

RuntimeError: a later error, a consequence
"""
MISSING = "ModuleNotFoundError: No module named 'nvidia_resiliency_ext'"
SRUN = "srun: error: node1: task 0: Exited with exit code 1"


def test_the_first_exception_line_is_the_cause_not_warnings_or_later_errors(tmp_path):
    log = tmp_path / "log-root-root.train_5_0.out"
    log.write_text(TRACEBACK)
    sbatch = tmp_path / "sbatch_root-root.train_5.out"
    sbatch.write_text(f"+ srun ...\n{SRUN}\n")
    assert joblog.first_error([sbatch, log]) == (f"{MISSING} ({log})", [])  # a cause beats Slurm's word, even later
    assert joblog.first_error([sbatch]) == (f"{SRUN} ({sbatch})", [])  # Slurm's, where nothing says why
    (tmp_path / "quiet.out").write_text("preflight: OK (8/8 ranks)\nall good\n")
    assert joblog.first_error([tmp_path / "quiet.out"]) == (None, [])


@pytest.mark.parametrize(
    "line",
    [
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",  # torchrun's prefix
        "3: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1",  # srun --label
        "error: segment 2/3: no checkpoint to resume from in /ck: refusing to start from iteration 0",  # entry.py
        "preflight failed on rank 3: SLURM_NTASKS=8 but the plan has 16 ranks",
        "KeyboardInterrupt",
    ],
)
def test_what_counts_as_a_cause(tmp_path, line):
    (tmp_path / "a.out").write_text(f"ok\nWARNING: something\n{line}\nRuntimeError: later\n")
    shown = line.removeprefix("error: ")  # "first error: error: ..." would say it twice
    assert joblog.first_error([tmp_path / "a.out"])[0] == f"{shown} ({tmp_path / 'a.out'})"


def test_the_line_is_one_printable_line_of_bounded_length(tmp_path):
    log = tmp_path / "a.out"
    log.write_bytes(b"ValueError: \x1b]0;PWNED\x07\x1b[2J" + b"x" * 100_000 + b"\nno newline at the end")
    line, _ = joblog.first_error([log])
    assert line.startswith("ValueError: \\x1b]0;PWNED\\x07\\x1b[2J") and "\x1b" not in line
    shown, where = line.rsplit(f" ({log})", 1)[0], f" ({log})"  # the error's text is bounded; the log's path follows
    assert line.endswith(where) and len(shown) <= joblog.SHOWN + 40 and line.isprintable()
    log.write_text("x" * (joblog.PIECE + 5) + "ValueError: inside a huge line, not the start of one\n")
    assert joblog.first_error([log]) == (None, [])


def test_planted_files_among_the_logs_are_skipped_with_their_reason_never_read(tmp_path, within):
    fifo, sock, real = tmp_path / "log-t_5_0.out", tmp_path / "log-t_5_1.out", tmp_path / "sbatch_t_5.out"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        real.write_text(f"{MISSING}\n")
        with within(10):
            line, skipped = joblog.first_error([fifo, sock, tmp_path / "gone.out", real, "/dev/zero"])
            ok, unread = joblog.readable([fifo, real, "/dev/zero"])
    assert line == f"{MISSING} ({real})" and len(skipped) == 3 and ok == [real] and len(unread) == 2
    assert all("is not a regular file (a FIFO, socket or device)" in s for s in [skipped[0], *unread])
    assert skipped[1] == f"{sock}: cannot be read (No such device or address)"  # a socket cannot even be opened
    assert skipped[2] == f"{tmp_path / 'gone.out'}: no longer there"


def test_a_log_past_the_ceiling_is_refused_without_being_read(tmp_path, monkeypatch):
    big = tmp_path / "a.out"
    big.write_text(f"{MISSING}\n" * 100)
    monkeypatch.setattr(jsonio, "LOG_LIMIT", 1000)
    assert joblog.first_error([big]) == (None, [f"{big}: is larger than 0 MiB, far past any real one of its kind"])


def test_a_jobs_logs_are_told_apart_by_their_job_id(tmp_path):
    names = ["log-t_5_0.out", "log-t_5_1.out", "sbatch_t_5.out", "log-t_15_0.out", "sbatch_t_15.out", "log-t_7_5.out"]
    names += ["slurm-5.out", "slurm-55.out", "sbatch_t_5.out.bak"]
    logs = [tmp_path / n for n in names]
    assert [p.name for p in joblog.of_job(logs, "5")] == [
        "log-t_5_0.out",
        "log-t_5_1.out",
        "sbatch_t_5.out",
        "slurm-5.out",
    ]
    assert [p.name for p in joblog.of_job(logs, "7")] == ["log-t_7_5.out"]


ABSENT = "ModuleNotFoundError: No module named 'overlapkit_absent_module'"


def _failing_job(tmp_path) -> tuple[str, str]:
    """A job that really fails on the local Slurm as rank 0 did (issue 40): this checkout's Python imports a module
    it lacks (one no install will ever add). (its id, its state once ended)"""
    out = tmp_path / "slurm-%j.out"
    cmd = f"{sys.executable} -c 'import overlapkit_absent_module'"
    job = slurm.sbatch_wrap(cmd, account="root", partition="local", name="joblog-test", output=str(out), after=[])
    return job, slurm.wait_for(job, timeout=300, poll=1)


@pytest.mark.slurm
def test_make_status_and_the_nightly_report_show_a_failed_jobs_first_error(tmp_path, make_here, write_plan):
    job, state = _failing_job(tmp_path)
    assert state.startswith("FAILED")
    run_dir, log = tmp_path / "run", tmp_path / f"slurm-{job}.out"
    run_dir.mkdir()
    write_plan(run_dir)  # the record a plain-sbatch job writes when it starts (cluster/submit.py claim)
    record = {"state": "submitted", "job_id": job, "job_ids": [job], "log": str(log), "run_dir": str(run_dir)}
    (run_dir / chain.MARKER).write_text(json.dumps(record))
    code, out, _ = make_here("status", f"RUN={run_dir}")
    assert code == 0 and out.splitlines()[1] == f"  job {job} FAILED; first error: {ABSENT} ({log})", out
    code, out, _ = make_here("status", f"RUN={run_dir}", "FORMAT=json")
    assert json.loads(out)["jobs"][0]["error"] == f"{ABSENT} ({log})"
    from overlapkit.nightly import night_report

    entry = {"recipe": "llama3_8b_pretrain_8gpu_h100_fp8cs", "nodes": 1, "run_dir": str(run_dir), "job_id": job}
    res = night_report.evaluate(entry, slurm.job_state(job), [log], tmp_path / "goldens", False)
    assert res["first_error"] == f"{ABSENT} ({log})" and f"first error: {ABSENT}" in night_report._row(res, None)
    subprocess.run(["scancel", job], check=False)  # ended already: nothing to cancel
