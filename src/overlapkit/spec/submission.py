"""A run's records of its jobs: submission.json in the run directory (cluster/submit.py writes it; make status, logs,
cancel, bless and calibrate read it) and the layout record beside the checkpoints (cluster/resume.py). Their typed
models; every field a reader uses of its type (job ids that Slurm's tools may be handed: never an option), or one line
naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, PositiveInt, ValidationInfo, create_model

# A Slurm job id as sbatch, squeue and sacct print it: digits; an array task <job>_<task>; a heterogeneous job's
# component <job>+<offset> (Slurm's job_array and heterogeneous_jobs documentation).
JOB_ID = re.compile(r"[0-9]+(?:[_+][0-9]+)?")


def job_id_problem(value, where: str) -> str | None:
    """Why `value` is not a job id to hand to Slurm's tools (one line naming `where`), or None."""
    if isinstance(value, str) and JOB_ID.fullmatch(value):
        return None
    shown = repr(value) if isinstance(value, str) else f"{type(value).__name__} {value!r}"
    return f"{where} is {shown[:80]}, not a Slurm job id (digits, or <job>_<task> / <job>+<offset>)"


def _job_id(value, info: ValidationInfo) -> str:
    if problem := job_id_problem(value, info.field_name):
        raise ValueError(problem)
    return value


JobId = Annotated[str, PlainValidator(_job_id)]


class _Submission(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    state: str = ""
    pid: PositiveInt | None = None
    job_id: JobId = None  # present, it is one (null included)
    job_ids: list[JobId] | None = None


PATHS = ("experiment_dir", "checkpoint_dir", "run_dir", "script", "log", "host", "cluster", "at", "reason")
# submission.json: `submitting` (pid, host) → `submitted` (job ids, experiment) or `failed` (reason), or `dryrun`,
# `sbatch-script`; a record from before `state` holds a job id only.
Submission = create_model("Submission", __base__=_Submission, **dict.fromkeys(PATHS, (str | None, None)))

SUBMISSION_MESSAGES = {
    "state": "state is {value!r}, not a word",
    "pid": "pid is {value!r}, not a process id",
    "job_ids": "job_ids is {value!r}, not a list",
    ":string_type": "{key} is {value!r}, not text",
}


class LayoutEntry(BaseModel):
    """One run's entry in the layout record: the layout it trained with from `from_iteration` on."""

    model_config = ConfigDict(strict=True, extra="allow")
    layout: dict
    from_iteration: int = Field(default=0, ge=0)


_ENTRY = "entry {i} is {entry!s:.40}, not {{from_iteration, layout}}"
LAYOUT_MESSAGES = {
    "": _ENTRY,
    "layout": _ENTRY,
    "from_iteration": "entry {i}'s from_iteration is {value!r}, not an iteration",
}
