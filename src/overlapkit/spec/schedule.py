"""The nightly chain's state, `<profile job_dir>/nightly/schedule.json` (nightly/schedule.py writes and reads it,
nightly/chain_status.py reads it): its typed model. What a reader hands on is checked: the queued scheduler's job id
(scancel and squeue get it), the secrets' names (sbatch's --export list), the night's options (its command line).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from overlapkit.spec.profile import SecretName
from overlapkit.spec.submission import JobId


class Schedule(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    cluster: str  # CLUSTER= as given: the restart hint repeats it
    profile: str  # the profile's file: the scheduler job reloads it
    partition: str
    account: str
    job_dir: str
    job_dir_given: str = ""
    at: str
    recipes: str
    preflight: str
    iters: int
    min_dp: int
    secrets: list[SecretName] = []  # names only: sbatch passes their values on from the shell
    active: bool = False
    scheduled_at: str | None = None
    job_id: JobId | None = None  # the queued scheduler job; None once unscheduled
    begin: str | None = None
    history: list[dict] = []  # the fired runs, oldest first


MESSAGES = {":missing": "lacks {key!r}"}
