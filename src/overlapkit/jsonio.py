"""The one file writer: atomic (a reader never sees half a file) and never through a planted link; the JSON writer on
it (indented, newline-terminated); the one guarded reader of a file a user or a co-user can plant (a regular file
only, a size ceiling, bounded decompression, strict numbers); and the one JSON reader on it: lenient for files that
may not be there yet, strict (one line naming the file's role and the fix) for a file a command needs."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
import stat
import zlib
from pathlib import Path
from typing import BinaryIO, TextIO

from overlapkit.errors import BadInput


def dumps(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_json(path: Path, data) -> Path:
    return write_text(path, dumps(data))


def write_text(path: Path, text: str | bytes, mode: int = 0o666) -> Path:
    """A temp file of a random name beside `path` (`create_new`: no planted link followed), renamed over it: a crash
    leaves the old file or the new, never half; a link at `path` is replaced, its target untouched."""
    path = Path(path)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        with contextlib.suppress(FileExistsError):  # 48 random bits taken: another writer's, or planted; draw again
            create_new(tmp, text, mode)
            break
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def create_new(path: Path, text: str | bytes, mode: int = 0o666) -> Path:
    """Create `path` holding `text` (O_EXCL|O_NOFOLLOW: FileExistsError for anything there, a planted link included);
    `mode` is subject to the umask; a failed write removes the file."""
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
    """The fd of the lock file `path` (created if missing) for flock, or with `append` of a log: opened in place (a
    lock keeps its inode, a log its lines), never through a link planted at its name; BadInput naming it otherwise."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        link = f"is a symbolic link to {os.readlink(path)}, never followed" if Path(path).is_symlink() else ""
        raise BadInput(f"{path} {link or f'cannot be opened ({exc.strerror})'}: remove it, then run again") from None


MiB = 1 << 20
# Size ceilings per kind of file read: far above any real one (a plan.json is ~40 KB, a 1,000-step Bridge log ~1 MB,
# a profiler trace of a few steps of 8 ranks tens of MB), far below what would take a 24 GB login node down.
RECORD_LIMIT = 16 * MiB  # plan.json, submission.json, overrides.json, calibrations, schedules, night records
LOG_LIMIT = 512 * MiB  # a training log
TRACE_LIMIT = 2048 * MiB  # a profiler trace, once unpacked
# The most a gzip file may unpack to, as a multiple of its size: the real PyTorch-profiler traces in
# tests/data/reference_traces pack 13-21x; gzip's own limit is about 1000x (a file of zeros), a bomb's ratio.
GZIP_RATIO = 100
INT64 = (-(1 << 63), (1 << 63) - 1)


class Unreadable(BadInput):
    """A file that cannot be read safely: `what` says why; the message is `<path>: <what>`."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = Path(path), what


def read_bytes(path: Path, limit: int = RECORD_LIMIT, *, follow: bool = True) -> bytes:
    """The bytes of the regular file `path` (`open_regular`), at most `limit`, gzip unpacked within `limit` too.
    FileNotFoundError passes; every other problem is one Unreadable."""
    with open_regular(path, follow=follow) as f:
        try:  # read(n) reserves n bytes: ask for the file's size (one more: a file past the limit shows it)
            data = f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
        except OSError as exc:
            raise Unreadable(path, f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise Unreadable(path, f"is larger than {limit // MiB} MiB, far past any real one of its kind")
    return gunzip(path, data, limit) if data[:2] == b"\x1f\x8b" else data


def open_regular(path: Path, limit: int | None = None, *, follow: bool = True) -> BinaryIO:
    """`path` open for reading (binary) when it is a regular file, of at most `limit` bytes when given: for a reader
    that streams (a log read line by line). Opened non-blocking, so a FIFO planted in its place never hangs the
    reader; a FIFO, socket, device or directory is refused before any read; `follow=False`: a symbolic link at `path`
    is refused (where only the project writes the file). FileNotFoundError passes; every other problem is one
    Unreadable."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if not follow and Path(path).is_symlink():
            raise Unreadable(path, "is a symbolic link, never followed here: remove it") from None
        raise Unreadable(path, f"cannot be read ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (limit is not None and info.st_size > limit):
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise Unreadable(path, "cannot be read (Is a directory)")
        if stat.S_ISREG(info.st_mode):
            raise Unreadable(path, f"is larger than {limit // MiB} MiB, far past any real one of its kind")
        raise Unreadable(path, "is not a regular file (a FIFO, socket or device): give the file itself")
    return os.fdopen(fd, "rb")


def open_text(path: Path, limit: int = LOG_LIMIT) -> TextIO:
    """`open_regular`'s file as text, decoded as open() would (UTF-8, bad bytes replaced): a log, line by line."""
    return io.TextIOWrapper(open_regular(path, limit), encoding="utf-8", errors="replace")


def gunzip(path: Path, data: bytes, limit: int) -> bytes:
    """`data` (gzip, one member or more) unpacked to at most `limit` and GZIP_RATIO times its size (at least 1 MiB)."""
    out, cap = bytearray(), min(limit, max(GZIP_RATIO * len(data), MiB))
    why = f"unpacks to more than {cap // MiB} MiB" + (
        f", over {GZIP_RATIO}x its size (a profiler trace packs about 20x): a gzip bomb, not a trace"
        if cap < limit
        else ", far past any real one of its kind"
    )
    try:
        while data:
            d = zlib.decompressobj(wbits=31)
            out += d.decompress(data, cap + 1 - len(out))
            if len(out) > cap or d.unconsumed_tail:
                raise Unreadable(path, why)
            if not d.eof:
                raise Unreadable(path, "is a truncated gzip file: copy it again")
            data = d.unused_data
    except zlib.error as exc:
        raise Unreadable(path, f"is not a readable gzip file ({exc})") from None
    return bytes(out)


INT64_DIGITS = 19  # len(str(2**63)): no integer within int64 has more significant digits


def integer(text: str) -> int | None:
    """The one reading of an integer as text (a JSON number, NODES=, a SET value, a log's iteration): ASCII digits
    after an optional '-', within int64, else None. Digits are counted before int() reads them (leading zeros too), so
    any length costs nothing and Python's 4300-digit limit is never reached."""
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > INT64_DIGITS:
        return None
    value = int(digits.lstrip("0") or "0")
    value = -value if text[:1] == "-" else value
    return value if INT64[0] <= value <= INT64[1] else None


def strict_int(text: str) -> int:
    """A JSON integer within int64 (`integer`); ValueError otherwise, as json's parse_int hook raises."""
    if (value := integer(text)) is None:
        raise ValueError(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range (int64)")
    return value


def bounded_int(text: str) -> int:
    """A JSON integer up to 64 digits, for files others write (a Hugging Face tokenizer_config.json's model_max_length
    is 1000000000000000019884624838656)."""
    if len(text.lstrip("-")) > 64:
        raise ValueError(f"the integer {text[:24]}... has more than 64 digits")
    return int(text)


def strict_float(text: str) -> float:
    """A finite JSON number (1e999 is not one)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def loads(raw: bytes | str, *, parse_float=strict_float, parse_int=strict_int):
    """JSON with strict numbers (integers within int64, or `parse_int`'s bound; finite floats; no NaN/Infinity),
    ValueError otherwise."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    return json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=_no_constant)


class FileProblem(BadInput):
    """A JSON file a command needs is missing or wrong: one line naming it, its role, the problem and the fix."""


_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}


def read_json(
    path: Path, kind: type = dict, *, role: str = "", fix: str = "", keys=(), missing_ok: bool = False, foreign=False
):
    """The JSON value of type `kind` (an object by default; a list for results.json) in `path`.

    Without `role`: None when there is none to read (missing, unreadable, not valid JSON: a file another process is
    still writing without write_json, or valid JSON of another type). With `role` (what the file is, for the
    message: "the night's record that make nightly writes") it is required and must hold `keys`: anything else is
    one FileProblem saying what is wrong, then `fix`; `missing_ok`: a missing file is None, a broken one an error.
    `foreign`: a file another tool writes (integers of any size up to 64 digits, not only int64)."""
    try:
        data, problem = _read(Path(path), kind, keys, bounded_int if foreign else strict_int)
    except FileNotFoundError:
        data, problem = None, None if missing_ok else "no such file"
    if problem and role:
        raise file_problem(path, problem, role, fix)
    return None if problem else data


def file_problem(path: Path, what: str, role: str, fix: str = "") -> FileProblem:
    """The one shape of the message: the file, what is wrong, what it should be, what to do."""
    return FileProblem(f"{path}: {what}; it should be {role}" + (f": {fix}" if fix else ""))


def _read(path: Path, kind: type, keys, parse_int) -> tuple[object, str | None]:
    """(value, None) or (None, what is wrong); FileNotFoundError passes."""
    try:
        raw = read_bytes(path)
    except Unreadable as exc:
        return None, exc.what
    try:
        data = loads(raw, parse_int=parse_int)
    except UnicodeDecodeError as exc:
        return None, f"is not text (byte {exc.start + 1} is not UTF-8)"
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        return None, "is empty" if not raw.strip() else f"is not JSON ({getattr(exc, 'msg', exc)})"
    if not isinstance(data, kind):
        return None, f"holds {_TYPES.get(type(data), 'null')}, not {_TYPES.get(kind, kind.__name__)}"
    if missing := [k for k in keys if k not in data]:
        return None, f"lacks {', '.join(map(repr, missing))}"
    return data, None
