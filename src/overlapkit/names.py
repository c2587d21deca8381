"""Names are names: the one check of a value that becomes a file or directory name (a profile's `name`, RUN_NAME, a
recipe or fork name, a cluster's calibration), and the one check that a path the project writes stays inside the
folder it belongs to.

A name is one path component of letters, digits, `.`, `_` and `-`, starting with a letter or a digit (so never
empty, never `.` or `..`, never hidden, never read as an option), with no `..` anywhere, and at most 64 characters.
Standard library only: the in-job entry and every stage may call it.
"""

from __future__ import annotations

import re
from pathlib import Path

from overlapkit.errors import BadInput, one_line

MAX_LEN = 64
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LEN - 1}}}", re.ASCII)
RULE = f"letters, digits, '.', '_' or '-', up to {MAX_LEN}, starting with a letter or digit, no '..'"


def checked_name(value, what: str, fix: str = "") -> str:
    """`value` if it is a name, else BadInput in one line: `what` (e.g. "RUN_NAME", "slurm/profiles/x.toml: name"),
    the value, why not (empty, not a string, or the rule), and `fix` (default: it names a directory)."""
    if not isinstance(value, str) or not value:
        problem = "empty" if value == "" else f"not a string ({type(value).__name__})"
    elif not _NAME.fullmatch(value) or ".." in value:
        problem = RULE
    else:
        return value
    shown = value if isinstance(value, str) else repr(value)
    raise BadInput(one_line(f"{what}={shown!r}: {problem}: {fix or 'it names a file or directory'}"))


def inside(root: Path, *parts: str | Path) -> Path:
    """`root / parts` as given, once checked that, links followed, it stays inside `root`: BadInput naming both when a
    part or a planted link leads elsewhere. For a path about to be opened for writing."""
    base, given = Path(root).resolve(), Path(root).joinpath(*parts)
    path = given.resolve()
    if path != base and base not in path.parents:
        raise BadInput(
            one_line(f"{given} resolves to {path}, outside {base}: remove the link or the '..' that leads there")
        )
    return given
