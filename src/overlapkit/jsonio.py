"""The one file writer: atomic (a reader never sees half a file) and never through a planted link; the JSON writer on
it (indented, newline-terminated); and the one JSON reader: lenient for files that may not be there yet, strict (one
line naming the file's role and the fix) for a file a command needs."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from overlapkit.errors import BadInput


def dumps(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_json(path: Path, data) -> Path:
    return write_text(path, dumps(data))


def write_text(path: Path, text: str | bytes, mode: int = 0o666) -> Path:
    """Write a new temp file in `path`'s directory under a random name (`create_new`: a link planted there is never
    followed, and the name cannot be guessed), then rename it over `path`: a crash leaves the old file or the new,
    never half, and a link at `path` itself is replaced, its target untouched."""
    path = Path(path)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            create_new(tmp, text, mode)
            break
        except FileExistsError:  # 48 random bits taken: another writer's, or planted; draw again
            continue
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def create_new(path: Path, text: str | bytes, mode: int = 0o666) -> Path:
    """Create `path`, which must not exist, holding `text` (O_EXCL|O_NOFOLLOW: FileExistsError for anything already
    there, a planted link included, never written through). `mode` (open()'s default) is subject to the umask; a
    failed write removes the file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return Path(path)


def open_lock(path: Path, mode: int = 0o600, *, append: bool = False) -> int:
    """The file descriptor of the lock file `path` (created if missing), for flock, or with `append` of a log to add
    to: opened in place, since a lock must keep its inode and a log its lines, and never through a link planted at its
    name (that would create, truncate or write to the link's target); BadInput naming it otherwise."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        link = f"is a symbolic link to {os.readlink(path)}, never followed" if Path(path).is_symlink() else ""
        raise BadInput(f"{path} {link or f'cannot be opened ({exc.strerror})'}: remove it, then run again") from None


class FileProblem(BadInput):
    """A JSON file a command needs is missing or not what it should be: one line naming the file, what it is (its
    role), what is wrong with it, and what to do."""


_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}


def read_json(path: Path, kind: type = dict, *, role: str = "", fix: str = "", keys=(), missing_ok: bool = False):
    """The JSON value of type `kind` (an object by default; a list for results.json) in `path`.

    Without `role`: None when there is none to read (missing, unreadable, not valid JSON: a file another process is
    still writing without write_json, or valid JSON of another type). With `role` (what the file is, for the
    message: "the night's record that make nightly writes") it is required and must hold `keys`: anything else is
    one FileProblem saying what is wrong, then `fix`; `missing_ok`: a missing file is None, a broken one an error."""
    try:
        data, problem = _read(Path(path), kind, keys)
    except FileNotFoundError:
        data, problem = None, None if missing_ok else "no such file"
    if problem and role:
        raise file_problem(path, problem, role, fix)
    return None if problem else data


def file_problem(path: Path, what: str, role: str, fix: str = "") -> FileProblem:
    """The one shape of the message: the file, what is wrong, what it should be, what to do."""
    return FileProblem(f"{path}: {what}; it should be {role}" + (f": {fix}" if fix else ""))


def _read(path: Path, kind: type, keys) -> tuple[object, str | None]:
    """(value, None) or (None, what is wrong); FileNotFoundError passes."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"is not text (byte {exc.start + 1} is not UTF-8)"
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        return None, "is empty" if not raw.strip() else f"is not JSON ({getattr(exc, 'msg', exc)})"
    if not isinstance(data, kind):
        return None, f"holds {_TYPES.get(type(data), 'null')}, not {_TYPES.get(kind, kind.__name__)}"
    if missing := [k for k in keys if k not in data]:
        return None, f"lacks {', '.join(map(repr, missing))}"
    return data, None
