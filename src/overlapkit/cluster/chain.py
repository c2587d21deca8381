"""A submitted run's jobs, one per segment (SEGMENTS=N: afterany chain): their states, the last checkpointed
iteration, and cancelling what has not ended. `make status` and `make cancel` read a run directory through here, and
a segment that finds training over cancels the segments after it (they would only start to exit)."""

from __future__ import annotations

from pathlib import Path

from overlapkit import jsonio
from overlapkit.cluster import resume, slurm
from overlapkit.errors import BadInput
from overlapkit.plan import planfile

MARKER = "submission.json"  # a run directory's record of its submission (cluster/submit.py writes it)
ROLE = "the run's submission record that make submit writes"
PATHS = ("experiment_dir", "checkpoint_dir", "run_dir", "script", "log", "host", "cluster", "at", "reason")


def checked_marker(run_dir: Path, info: dict) -> dict:
    """A run's submission record, every field a reader uses of its type (job ids that Slurm's tools may be handed:
    never an option), or one line naming the file, the field and the fix."""
    path, fix = Path(run_dir) / MARKER, "it was edited or written by another tool: restore it, or give another RUN="

    def bad(what: str):
        return jsonio.file_problem(path, what, ROLE, fix)

    if not isinstance(info.get("state", ""), str):
        raise bad(f"state is {info['state']!r}, not a word")
    for key in PATHS:
        if info.get(key) is not None and not isinstance(info[key], str):
            raise bad(f"{key} is {info[key]!r}, not text")
    pid = info.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 1):
        raise bad(f"pid is {pid!r}, not a process id")
    ids = info.get("job_ids")
    if ids is not None and not isinstance(ids, list):
        raise bad(f"job_ids is {ids!r}, not a list")
    for key, value in [("job_id", info.get("job_id"))] * ("job_id" in info) + [("job_ids", j) for j in ids or []]:
        try:
            slurm.checked_id(value, key)
        except BadInput as exc:
            raise bad(str(exc).partition(": nothing")[0]) from None
    return info


def job_ids(info: dict) -> list[str]:
    """Every job of a submission, in segment order (a run submitted before chains has one), each a checked id."""
    return [slurm.checked_id(j, f"{MARKER}'s job id") for j in list(info.get("job_ids") or [info.get("job_id")])]


def status_lines(run_dir: Path, info: dict) -> list[str]:
    """One line per segment (job, Slurm state), then the checkpoint: directory and last saved iteration."""
    ids = job_ids(info)
    out = []
    for i, job in enumerate(ids, 1):
        state = slurm.job_state(job)
        label = f"segment {i}/{len(ids)}: job {job} {state}" if len(ids) > 1 else f"job {job} {state}"
        pre = run_dir / (f"segment-{i}" if len(ids) > 1 else "") / "preflight.json"
        if pre.is_file():
            verdict = (jsonio.read_json(pre) or {}).get("ok")
            label += f"; preflight {'OK' if verdict is True else 'FAILED' if verdict is False else 'unreadable'}"
        out.append(label)
    ckdir = info.get("checkpoint_dir")
    if ckdir:
        run = planfile.read_plan(run_dir).get("run") or {}
        st, iters = resume.state(ckdir, run.get("ckpt_format") or "torch_dist"), run.get("train_iters")
        if st.problem:
            return [*out, f"checkpoints: {ckdir}: {st.problem}; a resume stops on it"]
        step = st.named
        last = f"iteration {step}" + (f" of {iters}" if iters else "") if step is not None else "none yet"
        if step is not None and st.lacks(step):
            back = st.fallback(step)
            then = f"a resume falls back to {back}" if back is not None else "no complete iteration before it"
            last += f" (incomplete: missing {', '.join(st.lacks(step))}; {then})"
        out.append(
            f"checkpoints: {ckdir}; last checkpointed {last}"
            + ("" if st.tracker or step is None else " (tracker missing)")
        )
    return out


def cancel(info: dict) -> list[str]:
    """Cancel every job of the chain that has not ended; one line per job saying what became of it."""
    out = []
    for job in job_ids(info):
        ended = slurm.cancel(job)
        out.append(f"job {job}: already {ended}: nothing to cancel" if ended else f"job {job}: cancelled")
    return out


def cancel_after(run_dir: Path, segment: int) -> list[str]:
    """Training is over: cancel the chain's segments after `segment` that have not ended; one line each."""
    info = jsonio.read_json(run_dir / MARKER) or {}
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
