"""The one JSON writer: indented, newline-terminated, and atomic (a reader never sees half a file); and the one
lenient reader, for files that may not be there yet."""

from __future__ import annotations

import json
from pathlib import Path


def dumps(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_json(path: Path, data) -> Path:
    """Write a sibling temp file, then rename it over `path`: a crash leaves the old file or the new, never half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data))
    tmp.replace(path)
    return path


def read_json(path: Path, kind: type = dict):
    """The JSON value of type `kind` (an object by default; a list for results.json) in `path`, or None when there
    is none to read: missing, unreadable, not valid JSON (a file another process is still writing without
    write_json), or valid JSON of another type."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        return None
    return data if isinstance(data, kind) else None
