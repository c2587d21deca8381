"""The env-var plugin: a plan's launch environment (its env.Ledger's values) exported through nemo_run's executor."""

from __future__ import annotations

from dataclasses import dataclass, field

import nemo_run as run

from overlapkit.errors import BadInput
from overlapkit.secrets import FIX, secret_problem


@dataclass(kw_only=True)
class EnvVarPlugin(run.Plugin):
    """Exports a ledger's values through nemo_run: `setup` merges them into the executor's env_vars, which nemo_run
    writes into the sbatch script, so secrets are refused here (they reach the job by name: cluster/slurm.py)."""

    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.env = dict(self.env)  # our own copy: later edits to the ledger's dict do not leak into a submitted job
        for name, value in self.env.items():
            if why := secret_problem(name, value):
                raise BadInput(f"{why}: {FIX}, not in env")
            if not isinstance(value, str):
                raise TypeError(f"{name}={value!r}: env values must be strings (executor.env_vars are exported)")

    def setup(self, task, executor) -> None:
        # A new dict: executors are cloned per task and may share their env_vars; the task (Script/Partial) is
        # left untouched, since the environment belongs to the executor.
        executor.env_vars = {**(executor.env_vars or {}), **self.env}
