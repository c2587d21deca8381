"""The one JSON writer: indented, newline-terminated, and atomic (a reader never sees half a file)."""

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
