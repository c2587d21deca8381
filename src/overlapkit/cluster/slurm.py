"""What we ask Slurm directly (sacct, squeue, sinfo, scancel, sbatch --wrap): job states, partition size, cancel,
and the one small CPU job the nightly submits without nemo_run. Every call has a timeout; none needs a shell; every
job id handed to a tool is checked by `checked_id` first, so a value read from a file is never taken as an option
(`scancel --me` would cancel every job of the user)."""

from __future__ import annotations

import re
import subprocess

from overlapkit.cluster.preflight import until
from overlapkit.errors import BadInput, ClusterFailure
from overlapkit.spec.runopts import minutes  # the time-limit rule's home: a segment's guards are there too
from overlapkit.spec.submission import job_id_problem

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")


def checked_id(value, where: str = "a job id") -> str:
    """`value` as a job id to hand to Slurm's tools, else BadInput naming `where`."""
    if problem := job_id_problem(value, where):
        raise BadInput(f"{problem}: nothing is handed to Slurm; fix or remove the record")
    return value


# What sbatch hands a job from the submitting shell (--export): PATH and the profile's secrets, by name; with ALL
# every variable of the shell, tokens included, was stored in slurmctld's job state. The job also gets SLURM_* and
# the user's login environment (sbatch(1), --export); sbatch sets SLURM_EXPORT_ENV to the same list, which srun reads
# as its own --export, so a script whose ranks need its own exports sets SLURM_EXPORT_ENV=ALL (STEP_EXPORT).
PASSED = ("PATH",)
STEP_EXPORT = {"SLURM_EXPORT_ENV": "ALL"}


def export_list(secrets=()) -> str:
    """sbatch's --export value: PASSED and the secrets' names."""
    return ",".join(dict.fromkeys([*PASSED, *secrets]))


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_state(job_id: str) -> str:
    """Slurm's final word from sacct (needs slurmdbd), else squeue's, else UNKNOWN."""
    out = _run(["sacct", "-X", "-n", "-P", "-j", checked_id(job_id), "-o", "State"])
    state = out.stdout.strip().splitlines()[0].split()[0] if out and out.returncode == 0 and out.stdout.strip() else ""
    if not state:
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        state = out.stdout.strip() if out else ""
    return state or "UNKNOWN"


def live_jobs(job_ids: list[str]) -> list[tuple[str, str]] | None:
    """(job id, state) of each of `job_ids` Slurm has not ended, in their order; None when squeue does not answer. A
    job squeue no longer knows has ended, and its "Invalid job id" for a list of only such ids is an answer too."""
    if not job_ids:
        return []
    out = _run(["squeue", "-h", "-j", ",".join(map(checked_id, job_ids)), "-o", "%i|%T"])
    if out is None or out.returncode != 0:
        return [] if out is not None and "Invalid job id" in out.stderr else None
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 1]
    states = {job: state for job, state in rows if not state.startswith(TERMINAL)}
    # squeue orders by its own priority (a running job before the pending ones); callers get submission order
    return [(job, states[job]) for job in job_ids if job in states]


def wait_for(job_id: str, timeout: float = 900, poll: float = 2) -> str:
    """The job's terminal state, or TIMEOUT_WAITING after `timeout` seconds."""
    return until(lambda: (said := job_state(job_id)).startswith(TERMINAL) and said, timeout, poll) or "TIMEOUT_WAITING"


def partition_info(partition: str) -> dict | None:
    """{"nodes", "gpus_per_node", "time_limit_min"} of `partition` ({}: none such; None: Slurm does not answer); the
    nodes of all its lines (node states) summed."""
    out = _run(["sinfo", "-h", "-p", partition, "-o", "%D|%G|%l"], timeout=20)
    if out is None or out.returncode != 0:
        return None
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2]
    if not rows:
        return {}
    gpus = [int(m.group(1)) for _, gres, _ in rows for m in [re.search(r"gpu(?::[^:,(]+)?:(\d+)", gres)] if m]
    limits = [minutes(lim) for _, _, lim in rows]
    return {
        "nodes": sum(int(d) for d, _, _ in rows if d.isdigit()),
        "gpus_per_node": max(gpus, default=0),
        "time_limit_min": None if None in limits else max(limits),
    }


def request_problems(profile, nodes: int, time_limit: str | None) -> list[str]:
    """Why the partition can never run this request (nodes, GPUs per node, time limit), one line each."""
    part, info = profile.partition, partition_info(profile.partition)
    if info is None:
        return [f"Slurm does not answer (sinfo -p {part}): submit from a login node of the cluster"]
    if not info:
        return [f"partition {part!r} does not exist here (sinfo -s lists them): fix partition in {profile.source}"]
    out = []
    if nodes > info["nodes"]:
        out.append(f"{nodes} nodes requested but partition {part} has {info['nodes']}: use NODES≤{info['nodes']}")
    if profile.gpus_per_node > info["gpus_per_node"]:
        out.append(
            f"{profile.gpus_per_node} GPUs per node requested but partition {part}'s nodes have "
            f"{info['gpus_per_node']}: fix gpus_per_node in {profile.source}"
        )
    want, cap = minutes(time_limit or ""), info["time_limit_min"]
    if want and cap is not None and want > cap:
        out.append(
            f"time limit {time_limit} exceeds partition {part}'s {cap} minutes: set time_limit in "
            f"{profile.source} at or below it"
        )
    return out


def cancel(job_id: str) -> str | None:
    """Cancel a job that has not ended; returns its final state instead when it already has (nothing cancelled)."""
    state = job_state(job_id)
    if state.startswith(TERMINAL):
        return state.split()[0]
    out = _run(["scancel", checked_id(job_id)])
    if out is None or out.returncode != 0:
        raise ClusterFailure(f"scancel {job_id} failed: {out.stderr.strip() if out else 'scancel did not answer'}")
    return None


def sbatch_wrap(
    cmd: str,
    *,
    account: str,
    partition: str,
    name: str,
    output: str,
    after: list[str],
    time_limit: str = "00:30:00",
    begin: str | None = None,
    comment: str | None = None,
    secrets=(),
) -> str:
    """Submit `cmd` as a one-task CPU job (`sbatch --wrap`) after every job in `after` ends (afterany), held until
    `begin` (any `sbatch --begin` time); `comment` is what queued() reads back. It gets PATH and `secrets` from this
    environment: a job that submits others passes their secrets on."""
    held = {"comment": comment, "begin": begin, "dependency": after and f"afterany:{':'.join(map(checked_id, after))}"}
    argv = ["sbatch", "--parsable", *(f"--{k}={v}" for k, v in held.items() if v), f"--export={export_list(secrets)}"]
    argv += [f"--account={account}", f"--partition={partition}", "--nodes=1", "--ntasks=1", f"--time={time_limit}"]
    out = _run([*argv, f"--job-name={name}", f"--output={output}", "--wrap", cmd])
    if out is None or out.returncode != 0:
        raise ClusterFailure(f"sbatch for {name} failed: {out.stderr.strip() if out else 'sbatch did not answer'}")
    return out.stdout.strip().split(";")[0]


def begin_time(at: str, *, account: str, partition: str, time_limit: str) -> str:
    """When a job held with `--begin=<at>` would start, as sbatch itself reads `at` (`sbatch --test-only`, Slurm's
    whole time grammar; nothing queued): ISO time, later than `at` where the partition is busy. BadInput with
    sbatch's own words when it refuses `at`; ClusterFailure when it refuses the job or does not answer."""
    argv = ["sbatch", "--test-only", f"--begin={at}", f"--account={account}", f"--partition={partition}"]
    out = _run([*argv, "--nodes=1", "--ntasks=1", f"--time={time_limit}", "--wrap", "true"])
    if out is None:
        raise ClusterFailure("sbatch did not answer, so AT cannot be read (is Slurm up? sinfo)")
    lines = [line.strip().removeprefix("sbatch: ").removeprefix("error: ") for line in out.stderr.splitlines()]
    said = "; ".join(line for line in lines if line)  # --test-only answers on stderr
    if out.returncode != 0 and "--begin" in out.stderr:  # "Invalid --begin specification": AT itself
        raise BadInput(said)
    if out.returncode != 0:  # the partition, account or QOS refused: the cluster's words, as sbatch prints them
        raise ClusterFailure(f"sbatch --test-only refused the scheduler job: {' '.join(out.stderr.split())}")
    if m := re.search(r"to start at (\S+)", said):
        return m[1]
    raise ClusterFailure(f"sbatch --test-only said no start time: {said[:200]}")


# squeue -O fields for queued(): EligibleTime is the job's --begin time (it stays put while the job waits, where %S
# turns into the scheduler's estimate or N/A). Comment goes last: it is free text and may hold the separator.
_QUEUED_FIELDS = ("JobID", "State", "EligibleTime", "Reason", "Comment")


def queued(name: str) -> list[dict] | None:
    """The caller's jobs called `name` in squeue: job_id, state, begin (EligibleTime), reason, comment. None when
    squeue does not answer (Slurm down): the caller must not read that as "no jobs"."""
    fmt = ",".join(f"{f}:|" for f in _QUEUED_FIELDS)  # `type:[.][size][suffix]`: no size, "|" as the suffix
    out = _run(["squeue", "--me", "-h", "-n", name, "-O", fmt], timeout=20)
    if out is None or out.returncode != 0:
        return None
    rows = [line.split("|", len(_QUEUED_FIELDS) - 1) for line in out.stdout.splitlines()]
    keys = ("job_id", "state", "begin", "reason", "comment")
    jobs = [dict(zip(keys, map(str.strip, row), strict=True)) for row in rows if len(row) == len(_QUEUED_FIELDS)]
    return [job | {"comment": job["comment"].removesuffix("|").strip()} for job in jobs]
