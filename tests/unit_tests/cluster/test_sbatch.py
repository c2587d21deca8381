"""Generated sbatch scripts, checked against committed golden files (as nemo_run's own tests do).

Two paths, two recipes each: nemo_run's dry run (SlurmExecutor + our env-var plugin) and the plain-sbatch path.
Paths that change per run (run directory, experiment id, checkout) are replaced by placeholders before comparing.
Regenerate with UPDATE_GOLDEN=1 after an intended change, and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from launch import commands
from overlapkit import makewatch, paths
from overlapkit.bridge import submission
from overlapkit.cluster import sbatch, submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import AuditFailed
from overlapkit.spec import runopts

GOLDEN = paths.REPO_ROOT / "tests" / "golden"
CASES = [
    ("llama3_70b_pretrain_64gpu_h100_bf16", "example-eos"),
    ("llama3_8b_pretrain_8gpu_h100_fp8cs", "local"),
    ("qwen3_235b_a22b_pretrain_256gpu_h100_bf16", "example-eos"),  # MoE: EP overlap, CUDA_DEVICE_MAX_CONNECTIONS=8
]


def normalise(text: str, sub: submit.Submission) -> str:
    text = text.replace(str(sub.run_dir), "<RUN_DIR>").replace(str(sub.profile.job_path), "<JOB_DIR>")
    text = re.sub(r"(<JOB_DIR>/experiments/[^/\s]+/)[^/\s]+_\d+", r"\1<EXP_ID>", text)
    return text.replace(str(paths.REPO_ROOT), "<REPO>")


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.read_text() == text, f"{name} differs; review, then UPDATE_GOLDEN=1"


@pytest.fixture
def prepared(tmp_path):
    """A shipped profile with its job_dir moved into tmp (example-eos points at /lustre)."""

    def make(recipe, cluster):
        profile = dataclasses.replace(load_profile(cluster), job_dir=str(tmp_path / "jobs"))
        return submission.prepare(recipe, profile, preflight_only=True, caller_env={"WANDB_API_KEY": "s3cr3t-value"})

    return make


@pytest.mark.parametrize(("recipe", "cluster"), CASES)
def test_nemo_run_sbatch_matches_golden(prepared, recipe, cluster):
    sub = prepared(recipe, cluster)
    text = normalise(submit.dryrun(sub), sub)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=" in text and "--mpi=pmix" in text
    assert "s3cr3t-value" not in text  # secrets travel by name from the shell: sbatch's --export, nothing else
    named = [line for line in text.splitlines() if "WANDB_API_KEY" in line or "--export" in line]
    want = ",".join(["PATH", *sub.profile.secrets])
    assert named == [f"#SBATCH --export={want}"] and "export SLURM_EXPORT_ENV=ALL" in text
    check(f"sbatch_nemo_run_{recipe}_{cluster}.sh", text)


@pytest.mark.parametrize(("recipe", "cluster"), CASES)
def test_plain_sbatch_matches_golden(prepared, recipe, cluster):
    sub = prepared(recipe, cluster)
    text = normalise(sbatch.render(sub), sub)
    assert "s3cr3t-value" not in text
    check(f"sbatch_plain_{recipe}_{cluster}.sh", text)


def test_70b_on_a_container_cluster_gets_the_overlap_env_pmix_and_the_container(prepared):
    sub = prepared("llama3_70b_pretrain_64gpu_h100_bf16", "example-eos")
    text = submit.dryrun(sub)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in text and "#SBATCH --nodes=8" in text
    assert f"--container-image {sub.profile.container_image}" in text and "--mpi=pmix" in text


@pytest.mark.parametrize(
    ("recipe", "value"), [("llama3_8b_pretrain_8gpu_h100_fp8cs", "32"), ("llama3_8b_pretrain_8gpu_h100_bf16", "1")]
)
def test_8b_fp8_gets_32_connections_and_8b_bf16_with_cp2_gets_1(prepared, recipe, value):
    text = submit.dryrun(prepared(recipe, "local"))
    assert f"export CUDA_DEVICE_MAX_CONNECTIONS={value}\n" in text


def test_audit_errors_submit_nothing(tmp_path):
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    with pytest.raises(AuditFailed, match="nothing submitted: TP overlap requested but Bridge drops it"):
        submission.prepare("llama3_70b_pretrain_64gpu_h100_bf16", profile, sets="model.sequence_parallel=false")
    assert not (tmp_path / "jobs").exists()


def test_uncommitted_changes_are_reported_because_only_head_ships(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "recipe.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(paths, "REPO_ROOT", repo)
    sha, dirty = submit.shipped_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", sha) and dirty == []
    (repo / "recipe.py").write_text("a = 2\n")
    assert submit.shipped_commit() == (sha, ["recipe.py"])


def test_a_run_directory_says_what_became_of_its_submission(tmp_path, capsys):
    """submitting → submitted | failed | dryrun; a `submitting` run whose process is gone is named an orphan, and
    logs/cancel on a run with no job are one line saying why (never a KeyError)."""

    gone = subprocess.Popen(["true"])
    gone.wait()
    run = tmp_path / "llama3_8b_pretrain_8gpu_h100_bf16-20261201-000000"
    run.mkdir()
    submit.mark(run, "submitting", pid=gone.pid, host=socket.gethostname())
    assert commands.call("status", ["--run", str(run)]) == 1
    assert f"orphan: its submitting process (pid {gone.pid}) died" in capsys.readouterr().out
    submit.mark(run, "submitting", pid=os.getpid(), host=socket.gethostname())
    assert commands.call("status", ["--run", str(run)]) == 1
    assert f"being submitted by pid {os.getpid()}" in capsys.readouterr().out
    submit.mark(run, "failed", reason="interrupted by SIGTERM")
    assert commands.call("logs", ["--run", str(run)]) == 2
    assert "has no job: submission failed at" in capsys.readouterr().err
    submit.mark(run, "dryrun")
    assert commands.call("status", ["--run", str(run)]) == 0
    assert "a dry run: nothing was submitted" in capsys.readouterr().out
    assert commands.call("cancel", ["--run", str(run)]) == 2


def test_a_signal_while_sbatch_is_in_flight_waits_for_the_job_id(tmp_path):
    """The critical section defers SIGTERM until the job id is on disk, then raises Interrupted."""
    import signal

    submit.install_signal_handlers(parent_var="NO_SUCH_VARIABLE")
    try:
        with pytest.raises(makewatch.Interrupted, match="SIGTERM"):
            with submit._critical():
                os.kill(os.getpid(), signal.SIGTERM)
                submit.mark(tmp_path, "submitted", job_id="7")  # still runs: the signal waits
        assert submit.read_marker(tmp_path)["job_id"] == "7"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def test_an_inherited_make_pid_is_watched_only_by_makes_descendants():
    """The Makefile's OVERLAPKIT_MAKE_PID reaches every process make starts, Slurm jobs included (sbatch exports the
    caller's environment); a process that make did not start must not stop because that pid is gone. Here the pid
    is a live process that is not the child's ancestor (a make on another machine, say): the child starts no watcher,
    and when that process dies the child sleeps on past the watcher's poll and ends normally (the next test is the
    positive side: a watcher that stopped every process would fail here)."""
    stranger = subprocess.Popen(["sleep", "60"])
    code = (
        "import sys, time; from overlapkit import makewatch; from overlapkit.cluster import submit; "
        "submit.install_signal_handlers(); print('watching' if makewatch._WATCHING else 'not watching', flush=True); "
        "sys.stdin.readline(); time.sleep(4 * makewatch.POLL_S); print('ran to the end', flush=True)"
    )
    env = {"PYTHONPATH": "src:.", "OVERLAPKIT_MAKE_PID": str(stranger.pid)}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    child = subprocess.Popen([sys.executable, "-c", code], cwd=paths.REPO_ROOT, env=env, text=True, **pipes)
    try:
        assert child.stdout.readline().strip() == "not watching", child.stderr.read()[-500:]
    finally:
        stranger.kill()
        stranger.wait()
    out, err = child.communicate("\n", timeout=60)  # the pid is gone now
    assert child.returncode == 0 and out.strip() == "ran to the end", err[-500:]


def test_a_descendant_of_make_is_stopped_by_sigterm_once_make_is_killed():
    """The watcher's positive side: a shell stands in for make (its pid in OVERLAPKIT_MAKE_PID, as the Makefile
    exports it) and starts a Python child that installs the handlers; the shell is killed by SIGKILL, so only the
    watcher can tell the child. The child reports the Interrupted its SIGTERM handler raised; a watcher that does
    nothing leaves it sleeping, and it reports that instead."""
    child = (
        "import time; from overlapkit import makewatch; from overlapkit.cluster import submit; "
        "submit.install_signal_handlers(); print('watching', flush=True)\n"
        "try:\n    time.sleep(20)\nexcept makewatch.Interrupted as exc:\n    print(exc, flush=True)\n"
        "else:\n    print('not stopped', flush=True)"
    )
    make = subprocess.Popen(
        ["sh", "-c", 'OVERLAPKIT_MAKE_PID=$$ "$0" -c "$1" & wait', sys.executable, child],
        cwd=paths.REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": "src:.", "PATH": "/usr/bin:/bin"},
    )
    try:
        assert make.stdout.readline().strip() == "watching", make.stderr.read()[-500:]
        make.kill()  # make dies by kill -9: nothing tells its child but the watcher
        make.wait()
        start = time.monotonic()
        rest, _ = make.communicate(timeout=60)  # the child holds the pipe: EOF when it has ended
    finally:
        make.kill()
    assert rest.strip() == "interrupted by SIGTERM" and time.monotonic() - start < 10


def test_pretraining_chain_sbatch_matches_golden(tmp_path):
    """RUN_NAME + SEGMENTS=2 + NSYS: one script per segment, each with Bridge's PreemptionPlugin signal and its
    overrides as the path-based entry's arguments. NSYS puts no nsys in front of the ranks: launch/entry.py runs the
    profiled ones under nsys itself (profile/profiled.py), the same on both paths, and the plain script says so."""
    profile = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    opts = runopts.RunOptions(run_name="golden", segments=2, nsys=(10, 12), nsys_ranks=(0, 4))
    sub = submission.prepare("llama3_8b_pretrain_8gpu_h100_bf16", profile, preflight_only=True, caller_env={}, run=opts)
    text = normalise(submit.dryrun(sub), sub)
    assert text.count("#SBATCH --signal=TERM@300") == 2 and "--segment 2 --segments 2" in text
    assert "nsys" not in text and "profiling." not in text  # the window travels in overrides.json
    plain = normalise(sbatch.render(sub), sub)
    assert "# NSYS=10:12 NSYS_RANKS=0,4: launch/entry.py runs those ranks under nsys profile" in plain
    check("sbatch_nemo_run_llama3_8b_pretrain_8gpu_h100_bf16_local_segments.sh", text)
    check("sbatch_plain_llama3_8b_pretrain_8gpu_h100_bf16_local_run_name.sh", plain)


def test_make_sbatch_gpu_h200_plans_the_job_for_h200(make_here, tmp_path):
    """`make sbatch GPU=h200`: the plan in the run directory and the request the job rebuilds are for H200."""
    profile = tmp_path / "mine.toml"
    text = (paths.REPO_ROOT / "slurm" / "profiles" / "local.toml").read_text()
    profile.write_text(text.replace('job_dir = "runs/slurm"', f'job_dir = "{tmp_path / "jobs"}"'))
    code, out, err = make_here("sbatch", "RECIPE=llama3_8b_pretrain_8gpu_h100_bf16", "GPU=h200", f"CLUSTER={profile}")
    assert code == 0, err
    assert "GPU=h200: an h100 recipe planned for H200 SXM" in out and "predicted on H200 SXM" in out
    (run_dir,) = (tmp_path / "jobs" / "runs").iterdir()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["gpu"] == plan["throughput"]["gpu"] == "h200"
    assert json.loads((run_dir / "overrides.json").read_text())["gpu"] == "h200"  # what launch/entry.py rebuilds
