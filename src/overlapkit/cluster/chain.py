"""A submitted run's jobs, one per segment (an afterany chain): their states, logs and first error line, the last
checkpointed iteration, and cancelling what has not ended (make status|logs|cancel; a segment that finds training
over cancels the segments after it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from overlapkit import jsonio
from overlapkit.cluster import joblog, resume, slurm
from overlapkit.errors import BadInput, one_line
from overlapkit.spec import model, planfile, submission

MARKER = "submission.json"  # a run directory's record of its submission (cluster/submit.py writes it)
ROLE = "the run's submission record that make submit writes"


def checked_marker(run_dir: Path, info: dict) -> dict:
    """A run's submission record checked by its model (spec/submission.py), or one line naming the field and the fix."""
    try:
        submission.Submission.model_validate(info)
    except ValidationError as exc:
        what = model.problem(exc, info, submission.SUBMISSION_MESSAGES)
        fix = "it was edited or written by another tool: restore it, or give another RUN="
        raise jsonio.file_problem(Path(run_dir) / MARKER, what, ROLE, fix) from None
    return info


def job_ids(info: dict) -> list[str]:
    """Every job of a submission, in segment order, each a checked id."""
    return [slurm.checked_id(j, f"{MARKER}'s job id") for j in list(info.get("job_ids") or [info.get("job_id")])]


def log_files(info: dict) -> list[Path]:
    """The job's logs in nemo_run's experiment directory; BadInput when the record names none, or one that is gone or
    not nemo_run's (no _CONFIG); none yet (a pending job): []."""
    where = info.get("experiment_dir")
    fix = "the job's logs are in the experiment directory nemo_run made at submission; if it was removed they are gone"
    if not where and info.get("log"):  # a plain-sbatch job (claim): the script's --output
        return [Path(info["log"])] if Path(info["log"]).exists() else []
    if not where:
        raise BadInput(f"{info.get('run_dir') or 'the run'}: its {MARKER} names no experiment_dir: {fix}")
    exp = Path(where)
    if not exp.is_dir():
        raise BadInput(f"experiment directory {exp} (from {MARKER}) no longer exists: {fix}")
    logs = sorted(exp.glob("*/log-*.out")) + sorted(exp.glob("*/sbatch_*.out"))
    if not logs and not (exp / "_CONFIG").is_file():  # none yet is a pending job's answer; no _CONFIG, not nemo_run's
        raise BadInput(f"{exp} (from {MARKER}) is not a nemo_run experiment directory (no _CONFIG in it): {fix}")
    return logs


def why_failed(info: dict, job: str) -> tuple[str | None, list[str]]:
    """(job `job`'s first error line with its file, or None), and one line for each thing not read (or why none)."""
    try:
        logs = joblog.of_job(log_files(info), job)
    except BadInput as exc:
        return None, [one_line(str(exc))]
    line, skipped = joblog.first_error(logs)
    if line is None and not skipped:
        return None, [f"no error line in its {len(logs)} log file(s) (make logs shows them)" if logs else "no log"]
    return line, skipped


def status(run_dir: Path, info: dict) -> dict:
    """The run's state (`make status FORMAT=json`): each job's segment, Slurm state, preflight and, for a job that
    failed, its first error line; then its checkpoints."""
    ids, jobs = job_ids(info), []
    for i, job in enumerate(ids, 1):
        state = slurm.job_state(job)
        entry = {"segment": i, "job_id": job, "state": state}
        entry["preflight"] = preflight_of(run_dir / (f"segment-{i}" if len(ids) > 1 else "") / "preflight.json")
        if state.split()[0].rstrip("+") in joblog.FAILED:
            entry["error"], entry["log_problems"] = why_failed(info, job)
        jobs.append(entry)
    return {"run": run_dir.name, "run_dir": str(run_dir), "jobs": jobs, "checkpoints": checkpoints(run_dir, info)}


def preflight_of(path: Path) -> dict | None:
    """A job's preflight.json as status shows it (ok, ranks, the first re-audit error); None before the job wrote
    it; {"ok": None, "problem": ...} for one that cannot be read."""
    try:
        pre = jsonio.read_json(path, role="the job's preflight verdict that rank 0 writes", missing_ok=True)
    except jsonio.FileProblem as exc:
        return {"ok": None, "problem": one_line(str(exc).partition("; it should be")[0])}
    if pre is None:
        return None
    errors = pre.get("reaudit_errors") if isinstance(pre.get("reaudit_errors"), list) else []
    ok = pre.get("ok") if isinstance(pre.get("ok"), bool) else None
    ranks = [pre.get(k) if isinstance(pre.get(k), int) else None for k in ("ranks_reported", "world_size")]
    return {"ok": ok, "ranks": ranks, "error": one_line(str(errors[0])) if errors else None}


def checkpoints(run_dir: Path, info: dict) -> dict | None:
    """The run's checkpoint directory and its last checkpointed iteration (resume.state); None without one."""
    ckdir = info.get("checkpoint_dir")
    if not ckdir:
        return None
    run = planfile.read_plan(run_dir).get("run") or {}
    st, iters = resume.state(ckdir, run.get("ckpt_format") or "torch_dist"), run.get("train_iters")
    out = {"dir": ckdir, "problem": st.problem, "last": st.named, "train_iters": iters, "tracker": bool(st.tracker)}
    if st.problem is None and st.named is not None and st.lacks(st.named):
        out.update(missing=list(st.lacks(st.named)), fallback=st.fallback(st.named))
    return out


def status_lines(run_dir: Path, info: dict) -> list[str]:
    record = status(run_dir, info)
    out = [job_line(job, len(record["jobs"])) for job in record["jobs"]]
    return out + ([checkpoint_line(record["checkpoints"])] if record["checkpoints"] else [])


def job_line(job: dict, of: int) -> str:
    """`segment 2/3: job 341 FAILED; preflight OK (8/8 ranks); first error: ...`: one line."""
    label = f"job {job['job_id']} {job['state']}"
    label = f"segment {job['segment']}/{of}: {label}" if of > 1 else label
    if (pre := job["preflight"]) is not None:
        verdict = {True: "OK", False: "FAILED"}.get(pre["ok"], "unreadable")
        ranks = f" ({pre['ranks'][0]}/{pre['ranks'][1]} ranks)" if None not in pre.get("ranks", [None]) else ""
        label += f"; preflight {verdict}{ranks}" + (f", {pre['error']}" if pre.get("error") else "")
        label += f" ({pre['problem']})" if pre.get("problem") else ""
    if "error" in job:
        label += f"; first error: {job['error']}" if job["error"] else ""
        label += "".join(f"; {p}" for p in job["log_problems"])
    return label


def checkpoint_line(ck: dict) -> str:
    if ck["problem"]:
        return f"checkpoints: {ck['dir']}: {ck['problem']}; a resume stops on it"
    step, iters = ck["last"], ck["train_iters"]
    last = f"iteration {step}" + (f" of {iters}" if iters else "") if step is not None else "none yet"
    if ck.get("missing"):
        back = ck["fallback"]
        then = f"a resume falls back to {back}" if back is not None else "no complete iteration before it"
        last += f" (incomplete: missing {', '.join(ck['missing'])}; {then})"
    last += "" if ck["tracker"] or step is None else " (tracker missing)"
    return f"checkpoints: {ck['dir']}; last checkpointed {last}"


def cancel(info: dict) -> list[str]:
    """Cancel every job of the chain that has not ended; one line per job saying what became of it."""
    ended = [(job, slurm.cancel(job)) for job in job_ids(info)]
    return [f"job {job}: already {was}: nothing to cancel" if was else f"job {job}: cancelled" for job, was in ended]


def cancel_after(run_dir: Path, segment: int) -> list[str]:
    """Training is over: cancel the chain's segments after `segment` that have not ended; one line each."""
    info = jsonio.read_json(run_dir / MARKER) or {}  # lenient: a record the job cannot read cancels nothing
    try:
        later = job_ids(info)[segment:] if info.get("job_id") else []
    except BadInput as exc:  # an edited record: nothing is handed to scancel, and the job says so
        return [f"later segments not cancelled: {exc}; make cancel RUN={run_dir}"]
    out = []
    for i, job in enumerate(later, segment + 1):
        try:
            ended = slurm.cancel(job)
        except RuntimeError as exc:  # scancel missing inside a container, the controller away: say so, go on
            out.append(f"segment {i} (job {job}): not cancelled: {exc}; make cancel RUN={run_dir}")
            continue
        out.append(f"segment {i} (job {job}): " + (f"already {ended}" if ended else "cancelled: training is over"))
    return out
