"""Submission: a planned, audited recipe (a record from bridge/submission.py) → its run directory → nemo_run's
SlurmExecutor, or the plain-sbatch path. nemo_run (10 s to import) is imported only where a job is built.

A run directory's submission.json says what became of it from the moment it exists: `submitting` (pid, host) →
`submitted` (job ids, experiment) or `failed` (why), or `dryrun`. A signal during a submission marks it failed, but
waits while sbatch is in flight, so a queued job is never left unrecorded; a `submitting` run whose process is gone
is an orphan, and `make status` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio, makewatch, paths
from overlapkit.cluster import chain, preflight, resume, runlock, slurm
from overlapkit.cluster.chain import MARKER, checked_marker
from overlapkit.cluster.profiles import placeholder_problem
from overlapkit.errors import AuditFailed, BadInput, ClusterFailure
from overlapkit.spec import runopts
from overlapkit.spec.profile import ClusterProfile
from overlapkit.spec.request import PlanRequest
from overlapkit.spec.topology import GPUS_PER_NODE


class SubmitError(BadInput):
    """One-line, user-facing: the request cannot be submitted as it stands (exit 2)."""


_SIGNALS = {"critical": False, "pending": None}


def _on_signal(signum, _frame):
    if _SIGNALS["critical"]:  # sbatch is in flight: finish recording its job id first
        _SIGNALS["pending"] = signum
        return
    raise makewatch.Interrupted(signum)


def install_signal_handlers(parent_var: str = makewatch.MAKE_PID) -> None:
    """SIGINT/SIGTERM/SIGHUP raise makewatch.Interrupted (never mid-sbatch); so does make's death (`parent_var`)."""
    makewatch.on_signals(_on_signal, parent_var=parent_var)


@contextlib.contextmanager
def _critical():
    _SIGNALS["critical"] = True
    try:
        yield
    finally:
        _SIGNALS["critical"] = False
    if (sig := _SIGNALS["pending"]) is not None:
        _SIGNALS["pending"] = None
        raise makewatch.Interrupted(sig)


def mark(run_dir: Path, state: str, /, **info) -> None:
    jsonio.write_json(run_dir / MARKER, {"state": state, "at": runlock.now(), **info})


@contextlib.contextmanager
def transaction(sub):
    """Whatever ends the block (an error, a signal, make's death), a run still `submitting` is marked failed."""
    try:
        yield sub
    except runlock.LiveRun:  # refused, not failed: the run directory never held a submission
        shutil.rmtree(sub.run_dir, ignore_errors=True)
        raise
    except BaseException as exc:
        if read_marker(sub.run_dir).get("state") == "submitting":
            mark(sub.run_dir, "failed", reason=str(exc) or type(exc).__name__)
        raise


def read_marker(run_dir: Path, strict: bool = False, keys=("state",)) -> dict:
    """The run's submission.json ({} if unreadable); `strict`: checked, or one line saying what is wrong with it."""
    if not strict:
        return jsonio.read_json(run_dir / MARKER) or {}
    fix = "give RUN=<a run directory under <job_dir>/runs> (none: the latest run)"
    return checked_marker(run_dir, jsonio.read_json(run_dir / MARKER, role=chain.ROLE, fix=fix, keys=keys))


@dataclass
class Submission:
    plan: object  # bridge/build.py Plan: its recipe, target, run options, ledger and run summary are read here
    profile: ClusterProfile
    run_dir: Path
    command: str  # what every rank runs on the plain-sbatch path
    preflight_only: bool = False  # recorded in submission.json: make bless refuses such a run
    checks: str = "full"
    plugins: object = list  # () -> nemo_run's run plugins of a task, made on the Bridge side (bridge/submission.py)

    def where(self) -> dict:
        """Where the run is, as its submission.json says (a job of it, or a script for sbatch)."""
        return {"cluster": self.profile.name, "run_dir": str(self.run_dir), "preflight_only": self.preflight_only}


def python_for(profile: ClusterProfile) -> str:
    return profile.python.replace("{repo}", str(paths.REPO_ROOT))


ENTRY = "launch/entry.py"  # a path-based script: Bridge's run plugins append their overrides to its arguments


def entry_args(plan, run_dir: Path, preflight_only: bool, checks: str, segment: int = 1) -> list[str]:
    """launch/entry.py's arguments for one rank of `segment` (the overrides are in the run's overrides.json)."""
    args = ["--recipe", plan.recipe.name, "--run-dir", str(run_dir), "--nodes", str(plan.target.nodes)]
    args += ["--checks", checks, "--segment", str(segment), "--segments", str(plan.run.segments)]
    return args + (["--preflight-only"] if preflight_only else [])


def preflight_mode(text: str) -> tuple[bool, str]:
    """PREFLIGHT= → (stop after the in-job preflight, which checks): "" or 0 trains; 1 or full stops after the
    preflight with rank 0's Bridge re-audit; env stops after the environment checks alone."""
    pre = (text or "").strip().lower()
    if pre not in ("", "0", "1", "env", "full"):
        raise BadInput(f"PREFLIGHT={text!r}: use 1 (preflight only) or env (preflight, no re-audit)")
    return pre in ("1", "env", "full"), "env" if pre == "env" else "full"


def accepted(
    plan, profile: ClusterProfile, *, preflight_only, caller_env, check_partition, dry, imports
) -> ClusterProfile:
    """The planned request refused on audit errors and, for a real submission (`check_partition`), on what it would
    refuse before anything is queued; returns the profile the run directory goes under (`dry`: under runs/).
    `imports`: this Python's training imports checked in process (software_problem)."""
    if not plan.report.ok:
        first = plan.report.errors[0]
        raise AuditFailed(f"audit failed ({len(plan.report.errors)} error(s)), nothing submitted: {first.message}")
    if (check_partition or dry) and (placeholder := placeholder_problem(profile)):
        raise SubmitError(f"{placeholder}; nothing submitted")
    if check_partition:
        limit = profile.time_limit or plan.recipe.time_limit
        why = unready(profile, plan.target.nodes, limit, caller_env) or (
            not preflight_only and software_problem(profile, imports)
        )
        if why:
            raise SubmitError(f"{why}; nothing submitted")
        for line in resume_lines(plan):  # what the job's resume guard would stop on, said before anything is queued
            print(line, file=sys.stderr)
    if dry and not preflight_only and (why := software_problem(profile, imports)):  # what a submit of it would refuse
        print(f"warning: make submit would refuse this: {why}", file=sys.stderr)
    if dry:  # nemo_run's experiment folder and the run directory: the profile's job directory where it is under
        # runs/ (the local Slurm's), else runs/dryrun/<profile>: nothing on the cluster's filesystem
        runs, job = paths.runs_root().resolve(), profile.job_path.resolve()
        home = profile.job_path if job == runs or runs in job.parents else runs / "dryrun" / profile.name
        profile = dataclasses.replace(profile, job_dir=str(home))
    return profile


def opened(plan, profile: ClusterProfile, run_dir: Path, preflight_only, checks, plugins) -> Submission:
    """The written run directory marked `submitting`, with what every rank of the plain-sbatch path runs (from the
    checkout: entry.py puts src/ on its own path)."""
    mark(run_dir, "submitting", pid=os.getpid(), host=socket.gethostname())
    command = f"exec {shlex.join([python_for(profile), ENTRY, *entry_args(plan, run_dir, preflight_only, checks)])}"
    return Submission(plan, profile, run_dir, command, preflight_only, checks, plugins)


def unready(profile: ClusterProfile, nodes: int, limit: str | None, caller_env=None) -> str | None:
    """The first of: why the partition can never run the request, a secret this shell does not export."""
    bad = slurm.request_problems(profile, nodes, limit)
    return bad[0] if bad else secrets_problem(profile, caller_env)


IMPORTS_TIMEOUT_S = 900  # a cold Bridge import in another Python: 30 s idle, minutes on a loaded login node
SOFTWARE_FIX = (
    "give the profile a python (or container_image) that has it (the NeMo container does), or PREFLIGHT=1 to run "
    "only the in-job checks"
)


def software_problem(profile: ClusterProfile, imports) -> str | None:
    """Why the job's Python cannot import what it trains with (launch/entry.py's imports): asked in this process by
    `imports()` when it is this environment (bridge/stack.py training_import_problem: the Bridge side), else by
    `<python> launch/entry.py --imports-only`; a container's, or one this host lacks, cannot be asked (a note on
    stderr says so)."""
    python = python_for(profile)
    found = None if profile.container_image else shutil.which(python)
    if not found:
        where = f"in container {profile.container_image}" if profile.container_image else "not on this host"
        print(
            f"note: the job's Python ({python}) is {where}: checked here the plan, the audit and the partition; not "
            "checked: its packages (a missing one stops the job at its first import; PREFLIGHT=1 checks the rest)",
            file=sys.stderr,
        )
        return None
    here = Path(found).absolute().parent.parent == Path(sys.prefix).absolute()  # a venv's bin/python: this one
    problem = imports() if here else _imports_in(found)
    return f"the job's Python ({python}) cannot start training: {problem}: {SOFTWARE_FIX}" if problem else None


def _imports_in(python: str) -> str | None:
    """What `python launch/entry.py --imports-only` says is missing, with the job's exports; a timeout is a note."""
    cmd = [python, str(paths.REPO_ROOT / ENTRY), "--imports-only"]
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}  # stack.import_bridge sets offline
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=IMPORTS_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        print(
            f"note: {shlex.join(cmd)} did not answer in {IMPORTS_TIMEOUT_S} s: its imports are not checked",
            file=sys.stderr,
        )
        return None
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 0 and last == preflight.IMPORTS_OK:
        return None
    if last.startswith("imports: "):
        return last.removeprefix("imports: ")
    err = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return f"{shlex.join(cmd)} fails: {' '.join(err.split())}"


def secrets_problem(profile: ClusterProfile, caller_env=None) -> str | None:
    """A secret the profile lists that this shell does not export (or exports empty), which the job's preflight would
    fail on after its wait in the queue: one line naming it, never a value."""
    env = os.environ if caller_env is None else caller_env
    if missing := [name for name in profile.secrets if not env.get(name)]:
        return (
            f"secret {missing[0]} (listed in {profile.source}) is not exported in this shell"
            + (f" (nor {', '.join(missing[1:])})" if missing[1:] else "")
            + ": export it, or remove it from the profile's secrets"
        )
    return None


def resume_lines(plan) -> list[str]:
    """The resume guard's notes on the checkpoint this plan would load, or a SubmitError where the job would stop."""
    if not plan.run.checkpoint_dir:
        return []
    verdict = resume.guard(plan.run_summary, plan.layout, f"RUN_NAME={plan.run.run_name}")
    if verdict.code == 1:
        raise SubmitError(f"{verdict.lines[-1][0].removeprefix('error: ')}; nothing submitted")
    return [line for line, _ in verdict.lines]


@contextlib.contextmanager
def _sole_live_run(run: runopts.RunOptions, run_dir: Path, besides=(), refused: str = "nothing submitted"):
    """The checkpoint directory's lock across "is a run live on it → sbatch → record the job ids" (cluster/runlock.py);
    yields the recorder of the job ids. A benchmark (no RUN_NAME) needs none."""
    where = run.checkpoint_dir
    if not where:
        yield lambda ids: None
        return
    with runlock.held(Path(where)):
        if problem := runlock.live_problem(Path(where), run.run_name, besides):
            raise runlock.LiveRun(f"{problem}; {refused}")
        yield lambda ids: runlock.record(Path(where), run_dir, ids)


def claim(run_dir: Path, job_id: str, run: runopts.RunOptions) -> dict:
    """The plain-sbatch path: a job of the script is known only once it starts, so its first step (entry.py --claim)
    records it as make submit does, under the same lock; where another run is live on the checkpoint directory (the
    script submitted twice, or while one ran) it stops instead (LiveRun)."""
    job_id = slurm.checked_id(job_id, "SLURM_JOB_ID (this job's id)")
    with _sole_live_run(run, run_dir, (job_id,), f"job {job_id} stops before training") as record_jobs:
        info = {k: v for k, v in read_marker(run_dir).items() if k not in ("state", "at", "job_id", "job_ids")}
        # the script's --output (slurm/templates/pretrain.sbatch): make logs reads it
        info |= {"job_id": job_id, "job_ids": [job_id], "log": str(run_dir / f"slurm-{job_id}.out")}
        mark(run_dir, "submitted", **info)
        record_jobs([job_id])
    return info


def local_runs() -> Path:
    """run-local's job directory: its checkpoints and run directories (runs/local, under paths.runs_root())."""
    return paths.runs_root() / "local"


def bind_local(req: PlanRequest) -> PlanRequest:
    """The request on this node (make run-local): one 8-GPU node, checkpoints under runs/local, no time limit."""
    return dataclasses.replace(req, nodes=1, run=dataclasses.replace(req.run, job_dir=str(local_runs())))


def slurm_executor(sub: Submission):
    import nemo_run as run
    from nemo_run.config import set_nemorun_home

    p = sub.profile
    # With a LocalTunnel, nemo_run writes the sbatch script under NEMORUN_HOME and sbatch reads it from the tunnel's
    # job_dir: both must be the same directory or sbatch cannot find the script.
    set_nemorun_home(str(p.job_path))
    return run.SlurmExecutor(
        account=p.account,
        partition=p.partition,
        nodes=sub.plan.target.nodes,
        ntasks_per_node=GPUS_PER_NODE,
        gpus_per_node=p.gpus_per_node,
        time=p.time_limit or sub.plan.recipe.time_limit,
        exclusive=p.exclusive or None,
        container_image=p.container_image or None,
        container_mounts=list(p.container_mounts),
        srun_args=list(p.srun_args),
        # PATH and the secrets by name, not the whole shell (slurm.export_list); the ranks get the script's exports
        additional_parameters={"export": slurm.export_list(sub.plan.ledger.secrets)},
        env_vars=dict(slurm.STEP_EXPORT),
        tunnel=run.LocalTunnel(job_dir=str(p.job_path / "experiments")),
        packager=run.GitArchivePackager(),  # ships this repo at its committed HEAD
    )


NEMO_RUN_LOG = "nemo_run.log"  # nemo_run's banners, tables and its tools' output, kept in the run directory


@contextlib.contextmanager
def _nemo_run_log(run_dir: Path):
    """nemo_run's console, logging and tools (git, sbatch) write into <run dir>/nemo_run.log, at the file descriptors
    too, so a nightly's hundreds of banner lines stay off the console; and read no stdin (its LocalTunnel runs them
    through invoke, which mirrors stdin, and a submission never needs input)."""
    fd = jsonio.open_lock(run_dir / NEMO_RUN_LOG, 0o644, append=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved, stdin = [os.dup(1), os.dup(2)], sys.stdin
    try:
        with open(fd, "w", closefd=False, buffering=1) as log, open(os.devnull) as sys.stdin:
            for out in (1, 2):
                os.dup2(fd, out)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
    finally:
        sys.stdin = stdin
        for out, f in zip((1, 2), saved, strict=True):
            os.dup2(f, out)
        for f in (*saved, fd):
            os.close(f)


@contextlib.contextmanager
def _experiment(sub: Submission):
    """nemo_run's experiment, one task per segment, each after the previous one ends however it ends (afterany: a
    segment that hit its time limit or was preempted hands over to the next, which resumes from the checkpoint)."""
    import nemo_run as run

    with _nemo_run_log(sub.run_dir):
        with run.Experiment(sub.plan.recipe.name, executor=slurm_executor(sub), log_level="ERROR") as exp:
            prev, n = None, sub.plan.run.segments
            for seg in range(1, n + 1):
                executor = slurm_executor(sub)
                executor.dependency_type = "afterany"
                args = entry_args(sub.plan, sub.run_dir, sub.preflight_only, sub.checks, seg)
                task = run.Script(path=ENTRY, args=args, entrypoint=python_for(sub.profile))
                name, after = "train" if n == 1 else f"train-seg{seg}", [prev] if prev else None
                prev = exp.add(task, executor=executor, name=name, plugins=sub.plugins(), dependencies=after)
            yield exp


def dryrun(sub: Submission) -> str:
    with _experiment(sub) as exp:
        exp.dryrun(log=False)
        return "\n".join(job._dryrun_info.request.materialize() for job in exp.jobs)  # nemo_run's sbatch scripts


def shipped_commit() -> tuple[str, list[str]]:
    """(HEAD sha, tracked files with uncommitted changes): GitArchivePackager ships HEAD only."""
    git = ["git", "-C", str(paths.REPO_ROOT)]
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return sha, [line[3:] for line in dirty.stdout.splitlines()]


def _job_ids(exp) -> list[str | None]:
    """Each job's Slurm id, the digits ending its nemo_run handle (None: it has none)."""
    return [m[1] if (m := re.search(r"(\d+)$", getattr(job, "handle", "") or "")) else None for job in exp.jobs]


def submit(sub: Submission) -> dict:
    """sbatch through nemo_run; the run directory is marked submitted (job id) or failed (why), never left open."""
    with transaction(sub), _sole_live_run(sub.plan.run, sub.run_dir) as record_jobs, _experiment(sub) as exp:
        with _critical():  # a signal now waits until the job id is on disk
            try:
                exp.run(detach=True)
            except Exception as exc:  # a chain is all or nothing: half a chain would train without its continuation
                queued = [job_id for job_id in _job_ids(exp) if job_id]
                for job_id in queued:  # the segments already queued when sbatch refused a later one
                    with contextlib.suppress(RuntimeError):
                        slurm.cancel(job_id)
                raise ClusterFailure(
                    f"submitting {len(exp.jobs)} job(s) failed ({exc}); cancelled the {len(queued)} already queued; "
                    f"nemo_run's output: {sub.run_dir / NEMO_RUN_LOG}"
                ) from exc
            exp_dir, ids = exp._exp_dir, _job_ids(exp)  # one per segment, in order
            if None in ids:
                handle = exp.jobs[ids.index(None)].handle
                raise ClusterFailure(f"nemo_run returned no Slurm job id (handle {handle!r}); see {exp_dir}")
            info = {"job_id": ids[0], "job_ids": ids, "experiment_dir": str(exp_dir), **sub.where()}
            info["checkpoint_dir"] = sub.plan.run.checkpoint_dir
            mark(sub.run_dir, "submitted", **info)
            record_jobs(ids)
    return info


# --- status / logs / cancel for a run directory -----------------------------------------------------------------


def load_submission(run_dir: Path) -> dict:
    """The marker of a run that reached Slurm; any other state, or an unreadable record, is one line saying what."""
    if not os.path.lexists(run_dir / MARKER):
        raise SubmitError(f"{run_dir} has no {MARKER}: not a submitted run (make submit writes it)")
    info = read_marker(run_dir, strict=True, keys=())
    if info.get("job_id"):
        return info
    raise SubmitError(f"{run_dir.name} has no job: {describe(info)}")


def describe(info: dict) -> str:
    """What a run directory's marker means, in one line (orphans named as such)."""
    state = info.get("state", "submitted" if info.get("job_id") else "unknown")
    if state == "failed":
        return f"submission failed at {info.get('at')}: {info.get('reason')}"
    if state == "dryrun":
        return "a dry run: nothing was submitted"
    if state == "sbatch-script":  # its job records itself when it starts (claim)
        return (
            f"a plain sbatch script (sbatch {info.get('script')}): no job of it has started yet; one still queued "
            "records itself here when it starts (squeue --me lists it)"
        )
    if state == "submitting":
        pid = info.get("pid") if isinstance(info.get("pid"), int) else -1  # checked_marker refuses another pid
        if info.get("host") == socket.gethostname() and not makewatch.alive(pid):
            return (
                f"orphan: its submitting process (pid {info.get('pid')}) died at an unknown point before "
                "recording a job id; resubmit with make submit"
            )
        return f"being submitted by pid {info.get('pid')} on {info.get('host')} since {info.get('at')}"
    return f"{state} (job {info.get('job_id')})"


def run_dir_of(profile: ClusterProfile, run: str = "", submitted: bool = True) -> tuple[Path, list[str]]:
    """RUN= as given, else the latest run under the profile's job directory (with a job, or in any state); and one
    line for each later run passed over because its record cannot be read (it never stops the others' status)."""
    if run:
        return Path(run), []
    root, skipped = profile.job_path / "runs", []
    for marker in sorted(root.glob(f"*/{MARKER}"), key=_mtime, reverse=True):
        try:
            info = read_marker(marker.parent, strict=True, keys=())
        except jsonio.FileProblem as exc:
            skipped.append(f"skipped {str(exc).partition('; it should be')[0]}")
            continue
        if not submitted or info.get("job_id"):
            return marker.parent, skipped
    raise SubmitError(f"no submitted runs under {root}: give RUN=<run directory>" + "".join(f"; {s}" for s in skipped))


def _mtime(path: Path) -> float:
    """When the record was last written; 0 for one removed since it was listed."""
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0
