"""Where the checkout is, and where the product keeps what it writes for you (runs/)."""

from __future__ import annotations

import os
from pathlib import Path

from overlapkit.errors import BadInput

REPO_ROOT = Path(__file__).resolve().parents[2]
# Hugging Face hub-cache layout with config.json only (no weights, no tokenizer): Bridge's Llama recipes call
# AutoBridge.from_hf_pretrained("meta-llama/..."), which reads just the config. Offline, a recipe builds in ms.
HF_CACHE = REPO_ROOT / "recipes" / "hf_cache"

# The one setting for where the product writes what it keeps for you: OVERLAPKIT_RUNS=<absolute directory> stands
# for the checkout's runs/ (git-ignored) everywhere: plan's run directories, run-local's runs/local, nemo_run's home,
# make calibrate's fits and what it searches, RUN= names, and a profile's job_dir under runs/ (the local profile's
# runs/slurm). Unset: <checkout>/runs. Read at each use, not at import: the plan server serves many environments.
RUNS_VAR = "OVERLAPKIT_RUNS"


def runs_root() -> Path:
    """The checkout's runs/, or where OVERLAPKIT_RUNS puts it (an absolute path: a relative one would move with each
    process's working directory)."""
    given = os.environ.get(RUNS_VAR, "")
    if not given:
        return REPO_ROOT / "runs"
    path = Path(given).expanduser()
    if not path.is_absolute():
        raise BadInput(
            f"{RUNS_VAR}={given}: not an absolute path: give a /directory, or unset it (the checkout's runs/)"
        )
    return path


def in_checkout(path: str | Path) -> Path:
    """A path as a profile or a record gives it, made absolute: ~ expanded, and a relative one in the checkout, where
    runs/... is under runs_root(). The one rule of where a job directory is: the jobs, the nights and their history
    (a night that ran under OVERLAPKIT_RUNS keeps its history there too)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return runs_root().joinpath(*p.parts[1:]) if p.parts[:1] == ("runs",) else REPO_ROOT / p


def repo_relative(path: Path) -> str:
    """`path` relative to the checkout when it is inside it (for one-line messages), else as given."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
