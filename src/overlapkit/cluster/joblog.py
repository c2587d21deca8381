"""A job's own logs: which of a run's log files are one job's, and the first line in them that says why the job
failed (make status, the nightly report), read a line at a time through jsonio's guarded reader (a FIFO, a device
or a file past the log ceiling is skipped with its reason) and shown as one printable line."""

from __future__ import annotations

import re
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import one_line

SHOWN = 300  # characters of the error line shown; the log has the rest
PIECE = 1 << 16  # characters read at a time: a newline-free file never becomes one huge line in memory

# What a failed job prints first about its cause, best first: a Python exception (the last line of a traceback:
# `ModuleNotFoundError: No module named 'x'`, `torch.OutOfMemoryError: CUDA out of memory`) or launch/entry.py's own
# one-line refusals (`error: ...`, `preflight failed on rank N: ...`); only when there is none, Slurm's own word
# (`srun: error: node1: task 0: Exited with exit code 1`, `slurmstepd: error: *** JOB 7 ... CANCELLED ...`), which
# says that a task ended, not why. A torchrun or `srun --label` rank prefix (`[rank0]: `, `0: `) is allowed.
_PREFIX = r"^(?:\[(?:rank|default)\d+\]:\s*|\d+:\s+)?"
CAUSE = re.compile(
    _PREFIX + r"(?:(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?$"
    r"|error: \S.*|preflight failed on rank \d+: .*)"
)
SLURM = re.compile(_PREFIX + r"(?:slurmstepd|srun|sbatch|salloc)(?:-[\w.-]+)?: error: .*")
# Slurm's states of a job that ended without finishing its work, where its log holds the why (not CANCELLED: someone
# cancelled it; not COMPLETED).
FAILED = ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED", "DEADLINE")


def of_job(logs: list[Path], job: str) -> list[Path]:
    """The files among `logs` that are job `job`'s: nemo_run names them `sbatch_<task>_<job>.out` and
    `log-<task>_<job>_<restart>.out`, a plain-sbatch job `slurm-<job>.out`."""
    job = re.escape(job)
    mine = re.compile(rf"log-.*_{job}_\d+\.out|sbatch_.*_{job}\.out|slurm-{job}\.out")
    return [p for p in logs if mine.fullmatch(Path(p).name)]


def readable(logs: list[Path]) -> tuple[list[Path], list[str]]:
    """The files of `logs` that can be read (regular files within the log ceiling), and one line for each other."""
    ok, skipped = [], []
    for path in logs:
        try:
            jsonio.open_regular(path, jsonio.LOG_LIMIT).close()
            ok.append(Path(path))
        except (jsonio.Unreadable, FileNotFoundError) as exc:
            skipped.append(one_line(str(exc) if isinstance(exc, jsonio.Unreadable) else f"{path}: no longer there"))
    return ok, skipped


def first_error(logs: list[Path]) -> tuple[str | None, list[str]]:
    """(the first line of `logs` that says why the job failed, with its file, else Slurm's first error line, else
    None), and one line for each file that could not be read."""
    slurm_line, skipped = None, []
    for path in logs:
        try:
            found = _scan(Path(path))
        except (jsonio.Unreadable, FileNotFoundError) as exc:
            skipped.append(one_line(str(exc) if isinstance(exc, jsonio.Unreadable) else f"{path}: no longer there"))
            continue
        if found and found[0] == "cause":
            return f"{found[1]} ({path})", skipped
        slurm_line = slurm_line or (found and f"{found[1]} ({path})")
    return slurm_line, skipped


def _scan(path: Path) -> tuple[str, str] | None:
    """("cause", line) for the first cause in the file, else ("slurm", line) for its first Slurm error, else None."""
    slurm_line, start = None, True
    with jsonio.open_text(path, jsonio.LOG_LIMIT) as f:
        for piece in iter(lambda: f.readline(PIECE), ""):
            line, start_of_line, start = piece.rstrip("\n"), start, piece.endswith("\n")
            if not start_of_line:  # the rest of a line longer than PIECE: not the start of a message
                continue
            if CAUSE.match(line):  # entry.py's own `error: ` shown without it: "first error: error: ..." says it twice
                return "cause", one_line(line.removeprefix("error: ")[:SHOWN])
            if slurm_line is None and SLURM.match(line):
                slurm_line = one_line(line[:SHOWN])
    return ("slurm", slurm_line) if slurm_line else None
