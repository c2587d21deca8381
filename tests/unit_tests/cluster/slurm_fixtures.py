"""Jobs on the real local Slurm that the cluster tests share."""

from __future__ import annotations

import subprocess


def held_job() -> str:
    """A job held in the local Slurm's queue (live until scancel): what a run that is still queued looks like."""
    argv = [
        "sbatch",
        "--parsable",
        "--hold",
        "--partition=local",
        "--account=root",
        "--output=/dev/null",
        "--wrap=true",
    ]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
