"""End to end on the real local Slurm (slurm/local/start.sh: 8 fake nodes × 8 fake GPUs): preflight-only runs.

Nothing is mocked: `make submit` plans, writes the run directory, and submits through nemo_run's SlurmExecutor with a
LocalTunnel; the job runs launch.entry on every rank; we read Slurm's verdict from sacct and each rank's record.
The jobs run the committed HEAD (nemo_run's GitArchivePackager), as on a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from launch import commands
from overlapkit import paths
from overlapkit.bridge import submission
from overlapkit.cluster import slurm, submit
from overlapkit.cluster.profiles import load_profile

pytestmark = pytest.mark.slurm
R8, R70 = "llama3_8b_pretrain_8gpu_h100_fp8cs", "llama3_70b_pretrain_64gpu_h100_bf16"


def wait(job_id: str, timeout: float = 600) -> str:
    state = slurm.wait_for(job_id, timeout, poll=0.5)  # sacct twice a second: the state seen as it ends
    return state.split()[0]


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((run_dir / "preflight").glob("rank-*.json"))]


def newest_run(root: Path, recipe: str) -> Path:
    return max(root.glob(f"{recipe}-*/submission.json"), key=lambda p: p.stat().st_mtime).parent


def check_ranks(run_dir: Path, world: int, nodes: int) -> list[dict]:
    ledger = json.loads((run_dir / "ledger.json").read_text())["values"]
    recs = ranks(run_dir)
    assert len(recs) == world and sorted(r["rank"] for r in recs) == list(range(world))
    assert all(r["env"] == ledger for r in recs)  # every rank saw exactly the ledger's values
    assert all(r["world_size"] == world and r["nodes"] == nodes and r["ok"] for r in recs)
    assert len({r["host"] for r in recs}) == nodes
    return recs


def test_make_submit_preflight_only_completes_with_the_ledger_on_every_rank(tmp_path):
    # A secret the intended way: its name in the profile, its value only in the submitting shell.
    planted = f"hf_{uuid.uuid4().hex}{uuid.uuid4().hex[:8]}"
    site = tmp_path / "site.toml"
    site.write_text(load_profile("local").path.read_text().replace("secrets = []", 'secrets = ["HF_TOKEN"]'))
    env = {**os.environ, "NCCL_DEBUG": "INFO", "HF_TOKEN": planted}  # NCCL_DEBUG: a stale shell export, reported
    out = subprocess.run(["make", "submit", f"RECIPE={R8}", f"CLUSTER={site}", "PREFLIGHT=1"], cwd=paths.REPO_ROOT,
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NCCL_DEBUG=INFO is exported in this shell" in out.stdout
    run_dir = newest_run(load_profile("local").job_path / "runs", R8)
    info = json.loads((run_dir / "submission.json").read_text())
    assert info["state"] == "submitted" and wait(info["job_id"]) == "COMPLETED"
    for name in ("plan.json", "config.yaml", "ledger.json", "preflight.json"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "preflight.json").read_text())
    assert summary["ok"] and summary["checks"] == "full" and summary["reaudit_errors"] == []
    recs = check_ranks(run_dir, world=8, nodes=1)
    assert recs[0]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"  # TP=CP=1
    written = [f for d in (run_dir, Path(info["experiment_dir"])) for f in d.rglob("*") if f.is_file()]
    assert len(written) > 10 and not [f for f in written if planted.encode() in f.read_bytes()]
    assert planted not in out.stdout + out.stderr
    # Cancelling a job that already ended says so instead of claiming a cancel.
    again = subprocess.run(["make", "-s", "cancel", f"RUN={run_dir}"], cwd=paths.REPO_ROOT, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and f"job {info['job_id']} ({run_dir.name}) already COMPLETED" in again.stdout


def test_a_request_the_partition_can_never_run_is_refused_before_anything_is_queued():
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    out = subprocess.run(["make", "submit", f"RECIPE={R8}", "CLUSTER=local", "NODES=16"], cwd=paths.REPO_ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "error: 16 nodes requested but partition local has 8: use NODES≤8" in out.stderr
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert not set(after) - set(queued)  # no new job (one of another session's may have ended meanwhile)


def test_kill_9_of_make_stops_its_submission_and_the_run_says_what_happened():
    root = load_profile("local").job_path / "runs"
    before = set(root.glob(f"{R8}-*"))
    proc = subprocess.Popen(["make", "submit", f"RECIPE={R8}", "CLUSTER=local", "PREFLIGHT=1"], cwd=paths.REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline, marker = time.monotonic() + 300, None
    while time.monotonic() < deadline and marker is None:
        new = [d for d in set(root.glob(f"{R8}-*")) - before if (d / "submission.json").is_file()]
        marker = new[0] / "submission.json" if new else None
        time.sleep(0.05)
    assert marker is not None, "make submit never created its run directory"
    os.kill(proc.pid, signal.SIGKILL)  # make only: its Python child is not told by the kernel
    proc.wait()
    pid = json.loads(marker.read_text())["pid"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "the submitting Python process outlived make"
    final = json.loads(marker.read_text())
    if final["state"] == "submitted":  # it was inside sbatch: the job id was recorded before it stopped
        subprocess.run(["scancel", final["job_id"]], check=False)
    else:
        assert final["state"] == "failed" and "interrupted by SIGTERM" in final["reason"], final


@pytest.fixture
def profile(tmp_path):
    return dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))


def test_70b_preflight_runs_64_tasks_across_8_nodes(preflight_night):
    _, jobs = preflight_night  # the shared night's 70B run: the recipe's own shape, 64 ranks, full re-audit
    (night,) = [d for d in (jobs / "nightly").iterdir() if d.is_dir()]
    entry = next(e for e in json.loads((night / "night.json").read_text())["entries"] if e["recipe"] == R70)
    run_dir = Path(entry["run_dir"])
    assert wait(entry["job_id"]) == "COMPLETED"
    recs = check_ranks(run_dir, world=64, nodes=8)
    assert {r["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] for r in recs} == {"1"}
    summary = json.loads((run_dir / "preflight.json").read_text())
    assert summary["ok"] and summary["checks"] == "full" and summary["reaudit_errors"] == []


def test_missing_pmix_fails_the_job_and_slurm_says_failed(profile, capsys):
    no_pmix = dataclasses.replace(profile, srun_args=())
    sub = submission.prepare(R70, no_pmix, nodes=4, preflight_only=True, checks="env", caller_env={})
    info = submit.submit(sub)
    assert wait(info["job_id"]) == "FAILED"
    failures = [f for r in ranks(sub.run_dir) for f in r["failures"]]
    assert failures and all("srun --mpi=pmix" in f for f in failures)
    capsys.readouterr()  # make status: the job's line names the first error its log holds (issue 40)
    assert commands.call("status", ["--run", str(sub.run_dir)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(f"  job {info['job_id']} FAILED") and "; first error: preflight failed on rank " in line
    assert "srun --mpi=pmix" in line and f"log-root-root.train_{info['job_id']}_0.out)" in line, line


def test_cancelled_job_is_reported_cancelled(profile, capsys):
    sub = submission.prepare(R8, profile, preflight_only=True, checks="full", caller_env={})
    info = submit.submit(sub)
    assert commands.call("cancel", ["--run", str(sub.run_dir)]) == 0
    assert wait(info["job_id"]) == "CANCELLED"
    assert commands.call("status", ["--run", str(sub.run_dir)]) == 0
    assert f"job {info['job_id']} CANCELLED" in capsys.readouterr().out


def test_twenty_submissions_at_once_all_complete(profile):
    subs = [submission.prepare(R8, profile, preflight_only=True, checks="env", caller_env={}) for _ in range(20)]
    infos = [submit.submit(s) for s in subs]
    assert len({i["job_id"] for i in infos}) == 20
    t0 = time.monotonic()
    states = [wait(i["job_id"], timeout=max(60, 600 - (time.monotonic() - t0))) for i in infos]
    assert states == ["COMPLETED"] * 20
    assert all(json.loads((s.run_dir / "preflight.json").read_text())["ok"] for s in subs)
