"""What we ask Slurm directly (sacct, squeue, sinfo, scancel, sbatch --wrap): job states, partition size, cancel,
and the one small CPU job the nightly submits without nemo_run. Every call has a timeout; none needs a shell."""

from __future__ import annotations

import subprocess
import time

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_state(job_id: str) -> str:
    """Slurm's final word from sacct (needs slurmdbd), else squeue's, else UNKNOWN."""
    out = _run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"])
    state = out.stdout.strip().splitlines()[0].split()[0] if out and out.returncode == 0 and out.stdout.strip() else ""
    if not state:
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        state = out.stdout.strip() if out else ""
    return state or "UNKNOWN"


def wait_for(job_id: str, timeout: float = 900, poll: float = 2) -> str:
    """The job's terminal state, or TIMEOUT_WAITING after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state.startswith(TERMINAL):
            return state
        time.sleep(poll)
    return "TIMEOUT_WAITING"


def partition_nodes(partition: str) -> int | None:
    """Nodes in `partition` (sinfo), or None when Slurm does not answer."""
    out = _run(["sinfo", "-h", "-p", partition, "-o", "%D"], timeout=20)
    counts = [int(x) for x in out.stdout.split() if x.isdigit()] if out else []
    return sum(counts) or None


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=True, timeout=30)


def sbatch_wrap(cmd: str, *, account: str, partition: str, name: str, output: str, after: list[str],
                time_limit: str = "00:30:00") -> str:  # fmt: skip
    """Submit `cmd` as a one-task CPU job (`sbatch --wrap`), after every job in `after` ends (afterany)."""
    argv = ["sbatch", "--parsable", f"--account={account}", f"--partition={partition}", "--nodes=1", "--ntasks=1",
            f"--time={time_limit}", f"--job-name={name}", f"--output={output}", "--wrap", cmd]  # fmt: skip
    if after:
        argv.insert(2, f"--dependency=afterany:{':'.join(after)}")
    out = _run(argv)
    if out is None or out.returncode != 0:
        raise RuntimeError(f"sbatch for {name} failed: {out.stderr.strip() if out else 'sbatch did not answer'}")
    return out.stdout.strip().split(";")[0]
