"""What make submit refuses before anything is queued, and what a submission may write (issues 40 and 43):

- a profile whose `name` is not a name (it becomes runs/calibration/<name>.json, runs/dryrun/<name>: C014/C015);
- a copied, unedited example profile: its placeholder, by file:line, key and what to put (submit, DRYRUN=1, sbatch);
- a dry run writes only under the checkout's runs/, never the cluster's (placeholder) job directory;
- nemo_run's banners go to the run directory's nemo_run.log, our own lines stay on the console;
- a job whose Python cannot import what training imports is refused at submit, asked the way the job starts;
- a read-only or full job directory is one line, and no half-written run directory is left (M065/M066).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from launch import commands
from overlapkit import paths
from overlapkit.bridge import stack
from overlapkit.bridge.build import make_plan, write_run_dir
from overlapkit.cluster import submit
from overlapkit.cluster.profiles import PROFILES_DIR, load_profile, placeholder_problem
from overlapkit.errors import BadInput
from overlapkit.spec.profile import ProfileError

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
EXAMPLE = PROFILES_DIR / "example-eos.toml"
NVRX = "cannot import megatron.bridge.training.pretrain: module 'nvidia_resiliency_ext' is not installed"


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def edited(tmp_path: Path, source: Path, name: str, **values: str) -> Path:
    """A copy of `source` at <tmp>/<name>.toml with each `key = "..."` line given a new value."""
    lines = []
    for line in source.read_text().splitlines():
        key = line.split("=")[0].strip()
        lines.append(f'{key} = "{values[key]}"' if key in values and "=" in line else line)
    out = tmp_path / f"{name}.toml"
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.mark.parametrize("name", ["../../nightly/goldens/llama3_70b", "a/b", "", "..", "eos\n"])
def test_a_profile_name_that_is_a_path_is_refused_where_the_profile_is_read(tmp_path, name):
    path = tmp_path / "evil.toml"
    path.write_text(f'name = {name!r}\naccount = "a"\npartition = "p"\n'.replace("\n'", "\\n'"))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: name=") and "name the cluster with letters" in msg


def test_a_profile_file_whose_name_is_not_a_name_is_refused_too(tmp_path):
    path = tmp_path / "my cluster.toml"
    path.write_text('account = "a"\npartition = "p"\n')
    with pytest.raises(ProfileError, match=r"my cluster\.toml: the file's name='my cluster': letters, digits"):
        load_profile(path)


def test_an_unedited_copy_of_the_example_names_each_placeholder_line_until_none_is_left(tmp_path):
    copy = tmp_path / "mycluster.toml"
    copy.write_text(EXAMPLE.read_text())
    profile = load_profile(copy)  # a plan may still read it: only what submits refuses it
    assert placeholder_problem(profile) == (
        f"{copy}:{line_of(copy, 'account = ')}: account = 'my-account' is a placeholder: put your Slurm account "
        "(sacctmgr show assoc user=$USER format=account)"
    )
    copy = edited(tmp_path, EXAMPLE, "mycluster", account="ml-infra")
    assert placeholder_problem(load_profile(copy)) == (
        f"{copy}:{line_of(copy, 'job_dir = ')}: job_dir = '/lustre/fsw/my-account/nemo_run' is a placeholder: put "
        "a directory on the shared filesystem every node sees"
    )
    copy = edited(tmp_path, EXAMPLE, "mycluster", account="ml-infra", job_dir=str(tmp_path / "fs"))
    assert placeholder_problem(load_profile(copy)) is None
    copy.write_text(copy.read_text().replace('NCCL_SOCKET_IFNAME = "bond0"', 'NCCL_SOCKET_IFNAME = "CHANGE_ME"'))
    assert placeholder_problem(load_profile(copy)).startswith(
        f"{copy}:{line_of(copy, 'NCCL_SOCKET_IFNAME')}: env.NCCL_SOCKET_IFNAME = 'CHANGE_ME' is a placeholder"
    )
    assert placeholder_problem(load_profile("local")) is None


@pytest.mark.parametrize(
    ("action", "extra", "word"), [("submit", ["--dryrun", "1"], "submitted"), ("sbatch", [], "written")]
)
def test_submit_dryrun_and_sbatch_refuse_the_copy_before_bridge_and_create_nothing(
    tmp_path, capsys, action, extra, word
):
    copy = tmp_path / "mycluster.toml"
    copy.write_text(EXAMPLE.read_text())
    placeholder_dir, existed = Path("/lustre/fsw/my-account"), Path("/lustre/fsw/my-account").exists()
    assert commands.call(action, ["--recipe", R8, "--cluster", str(copy), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {copy}:{line_of(copy, 'account = ')}: account = 'my-account' is a placeholder: put your Slurm "
        f"account (sacctmgr show assoc user=$USER format=account); nothing {word}"
    )
    assert placeholder_dir.exists() == existed


def test_a_dry_run_writes_only_under_the_checkouts_runs_and_keeps_nemo_runs_banners_in_its_log(
    tmp_path, monkeypatch, capfd
):
    """The example filled in, its job directory on the 'cluster's filesystem' (tmp/fs): the dry run, through the real
    command, plans and prints nemo_run's script but creates nothing there; nemo_run's banner is in the run
    directory's nemo_run.log, not on the console; the job's Python in a container is said to be unchecked."""
    fs = tmp_path / "fs"
    copy = edited(tmp_path, EXAMPLE, "mycluster", account="ml-infra", job_dir=str(fs / "jobs"))
    monkeypatch.setenv("OVERLAPKIT_RUNS", str(tmp_path / "checkout" / "runs"))
    assert commands.call("submit", ["--recipe", R8, "--cluster", str(copy), "--dryrun", "1"]) == 0
    out, err = capfd.readouterr()
    assert not fs.exists()
    (run_dir,) = (tmp_path / "checkout" / "runs" / "dryrun" / "mycluster" / "runs").glob(f"{R8}-*")
    assert {"plan.json", "ledger.json", "overrides.json", "inputs.json", "submission.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert "Entering Experiment" in (run_dir / submit.NEMO_RUN_LOG).read_text()
    assert "Entering Experiment" not in out + err  # nemo_run's banner, kept off the console
    assert "#SBATCH --account=ml-infra" in out and f"dry run: nothing submitted; plan and ledger in {run_dir}" in out
    assert f"a submit writes under {fs / 'jobs'}" in out
    assert "note: the job's Python (python) is in container nvcr.io/nvidia/nemo:26.08" in err


@pytest.mark.slurm
def test_a_real_submit_whose_python_cannot_import_training_is_refused_before_anything_is_queued(tmp_path, capsys):
    """CLUSTER=local as a user types it, on the real local Slurm: this checkout's .venv is the job's Python, and it
    lacks nvidia-resiliency-ext (pyproject.toml's overrides), which Bridge's pretrain imports: refused, one line,
    no job queued, no run directory."""
    copy = edited(tmp_path, PROFILES_DIR / "local.toml", "mylocal", job_dir=str(tmp_path / "jobs"))
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert commands.call("submit", ["--recipe", R8, "--cluster", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    python = paths.REPO_ROOT / ".venv" / "bin" / "python"
    assert err.startswith(f"error: the job's Python ({python}) cannot start training: {NVRX}: give the profile")
    assert err.endswith("or PREFLIGHT=1 to run only the in-job checks; nothing submitted") and "\n" not in err
    assert not list((tmp_path / "jobs").glob("runs/*"))
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert not set(after) - set(queued)


def test_another_python_is_asked_through_the_entry_itself(tmp_path):
    """A job's Python that is not this environment: `<python> launch/entry.py --imports-only`, as the ranks start
    (here this interpreter without its site-packages: no Bridge at all, nor pydantic, which the entry reads its
    records with: the first module it stops on is named)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {paths.REPO_ROOT / ".venv/bin/python"} -S "$@"\n')
    python.chmod(0o755)
    profile = load_profile("local").__class__(
        name="x", account="a", partition="p", container_image=None, python=str(python)
    )
    entry = f"{python} {paths.REPO_ROOT / submit.ENTRY} --imports-only"
    assert submit.software_problem(profile, stack.training_import_problem) == (
        f"the job's Python ({python}) cannot start training: {entry} fails: ModuleNotFoundError: No module named "
        f"'pydantic': {submit.SOFTWARE_FIX}"
    )


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` fail (EFBIG) as on a full disk: a real write error from the kernel."""
    old, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


@contextlib.contextmanager
def read_only(path: Path):
    """`path` not writable by this process: mode 0555, and as root (who ignores modes) the effective user nobody."""
    path.chmod(0o555)
    root = os.geteuid() == 0
    if root:
        os.seteuid(65534)
    try:
        yield
    finally:
        if root:
            os.seteuid(0)
        path.chmod(0o755)


def test_a_full_job_dir_is_one_line_and_leaves_no_half_written_run_directory(tmp_path):
    plan = make_plan(R8)
    runs = tmp_path / "jobs" / "runs"
    runs.mkdir(parents=True)
    with file_size_limit(4096), pytest.raises(BadInput) as err:
        write_run_dir(plan, runs)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"cannot write the run directory under {runs} (File too large: ")
    assert msg.endswith(
        "nothing written; give a job directory you can write with free space (the profile's job_dir, or JOB_DIR=)"
    )
    assert list(runs.iterdir()) == []  # the plan is frozen: it names no run directory either


def test_a_read_only_job_dir_is_one_line_and_writes_nothing():
    plan = make_plan(R8)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        top = Path(tmp)
        top.chmod(0o755)  # reachable by the unprivileged user the test becomes
        (top / "jobs").mkdir()
        with read_only(top / "jobs"), pytest.raises(BadInput) as err:
            write_run_dir(plan, top / "jobs" / "runs")
        assert f"cannot write the run directory under {top / 'jobs' / 'runs'} (Permission denied" in str(err.value)
        assert list((top / "jobs").iterdir()) == []


@pytest.mark.slurm
def test_a_real_submit_keeps_nemo_runs_banners_in_the_run_directory_and_says_its_own_line(tmp_path, capfd):
    """PREFLIGHT=1 on the real local Slurm through the real nemo_run: the console has our line, the run directory's
    nemo_run.log has nemo_run's banners (the nightly submits through the same code)."""
    copy = edited(tmp_path, PROFILES_DIR / "local.toml", "mylocal", job_dir=str(tmp_path / "jobs"))
    assert commands.call("submit", ["--recipe", R8, "--cluster", str(copy), "--preflight", "1"]) == 0
    out, err = capfd.readouterr()
    (run_dir,) = (tmp_path / "jobs" / "runs").glob(f"{R8}-*")
    info = submit.read_marker(run_dir)
    subprocess.run(["scancel", info["job_id"]], check=False)  # its preflight is not what this test is about
    assert f"submitted job {info['job_id']} to mylocal; run directory: {run_dir}" in out
    log = (run_dir / submit.NEMO_RUN_LOG).read_text()
    assert "Launching job train" in log and "Entering Experiment" in log
    assert "Launching job" not in out + err and "Entering Experiment" not in out + err
