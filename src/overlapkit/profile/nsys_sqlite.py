"""Reading one Nsight Systems SQLite export (`nsys export --type sqlite`): the GPU kernels, the copy-engine
transfers, the NVTX ranges and the CUDA runtime launches that tie a kernel to the range it was launched in.

Tables and columns as Nsight's "SQLite Export Schema Reference" documents them
(docs.nvidia.com/nsight-systems/UserGuide/index.html#sqlite-schema-reference; the same in the 2021.5 exporter page):
StringIds(id, value); CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, streamId, correlationId, demangledName);
CUPTI_ACTIVITY_KIND_MEMCPY(..., bytes, copyKind); CUPTI_ACTIVITY_KIND_RUNTIME(start, end, globalTid, correlationId,
nameId); NVTX_EVENTS(start, end, eventType, text, textId, globalTid); TARGET_INFO_GPU(id, name). Times are ns on one
clock. Tables are created lazily: a report without NVTX or memcpy activity has none, and that is not an error.

Every bad file is one ProfileError line that says what to do, never a traceback; a row that is null where the schema
says NOT NULL, of another type, ending before it starts, negative or beyond MAX_NS refuses the file (naming its
kernel): a profile is read whole and as written, or refused. `load` reads either kind (PyTorch traces:
profile/torch_trace.py).
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.spec.planfile import PLAN

# CUpti_ActivityMemcpyKind (CUPTI docs, cupti_activity.h): 10 is CUPTI_ACTIVITY_MEMCPY_KIND_PTOP, a peer-to-peer
# copy between two GPUs, which is what Transformer Engine's copy-engine ring exchange issues.
MEMCPY_PTOP = 10
# NVTX_EVENTS.eventType of a push/pop or start/end range (Nsight's ENUM_NSYS_EVENT_TYPE: 59 NvtxPushPopRange,
# 60 NvtxStartEndRange); marks (34) have no duration and are not ranges.
NVTX_RANGES = (59, 60)
SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file (sqlite.org/fileformat)
# The latest time a profile may hold, in ns: 2^62 ns after the epoch is the year 2116 (a PyTorch trace's epoch-based
# clock, x1000, is about 1.8e18 in 2026). Beyond it a timestamp is corrupt, and near 2^63 it overflows the int64 that
# every consumer downstream (numpy, sqlite) keeps it in.
MAX_NS = 2**62


class ProfileError(BadInput):
    """A profile that cannot be read: one line, with the fix."""


class Activity(NamedTuple):
    """One kernel or one memcpy on one GPU stream (a tuple: a profile holds hundreds of thousands, built at C speed)."""

    start: int  # ns
    end: int
    device: int
    stream: int
    name: str  # the demangled kernel name; "memcpy <kind>" for a copy
    correlation: int
    copy_kind: int | None = None  # memcpys only
    nbytes: int | None = None
    group: str = ""  # the NCCL kernel's process group (PyTorch traces: its description, else its name)


def activity(path: Path, start, end, device, stream, name: str, correlation, **more) -> Activity:
    """The row as an Activity, or one ProfileError naming the kernel and what is wrong with its row."""
    for what, v in (("start", start), ("end", end), ("deviceId", device), ("streamId", stream)):
        if type(v) is not int:
            raise ProfileError(f"{path}: kernel {name[:120]!r} has {what} {v!r}, not an integer: {NOT_WHOLE}")
    if not 0 <= start <= end <= MAX_NS:
        why = "ends before it starts" if end < start else "has a negative time" if start < 0 else "ends past 2^62 ns"
        raise ProfileError(f"{path}: kernel {name[:120]!r} {why} ({start}..{end} ns): {NOT_WHOLE}")
    return Activity(start, end, device, stream, name, correlation if type(correlation) is int else -1, **more)


NOT_WHOLE = "the profile is damaged; profile the run again (the report never guesses a time)"


class Range(NamedTuple):
    start: int
    end: int
    text: str
    tid: int | str  # the launching thread: hashable, as the readers check


@dataclass
class Profile:
    path: Path
    kernels: list[Activity]
    memcpys: list[Activity]
    ranges: list[Range] = field(default_factory=list)  # NVTX ranges, CPU time
    # correlationId → (launch start, globalTid, ...): a launch's start and thread first, whatever follows
    launches: dict[int, tuple] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)  # TARGET_INFO_GPU names
    rank: int | None = None  # the global rank, where the profile records it (PyTorch traces); else from the name

    @property
    def devices(self) -> list[int]:
        return sorted({a.device for a in self.kernels} | {a.device for a in self.memcpys})


EXPORT = "nsys export --type sqlite --output {sqlite} {rep}"


def export(nsys: str, base: Path) -> str | None:
    """`nsys export --type sqlite` of base.nsys-rep into base.sqlite (via the node's $TMPDIR); None, or what failed."""
    rep = base.with_name(base.name + ".nsys-rep")
    if not rep.is_file():
        return f"nsys wrote no {rep.name} (did the run reach the profiled steps?)"
    with tempfile.TemporaryDirectory(prefix="overlapkit-nsys-") as tmp:
        local = Path(tmp) / (base.name + ".sqlite")
        cmd = [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={local}", str(rep)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0 or not local.is_file():
            last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"nsys export of {rep} failed ({last[0]}); rerun: nsys export --type=sqlite {rep}"
        part = base.with_name(base.name + ".sqlite.part")
        shutil.copyfile(local, part)
        os.replace(part, base.with_name(base.name + ".sqlite"))
    return None


def read(path: Path) -> Profile:
    """The profile in `path` (an .sqlite export, or an .nsys-rep exported first)."""
    path = Path(path)
    if path.suffix == ".nsys-rep":  # its export beside it is read, made with nsys where it is missing
        rep, path = path, path.with_suffix(".sqlite")
        if not path.is_file():
            if (nsys := shutil.which("nsys")) is None:
                cmd = EXPORT.format(sqlite=path, rep=rep)
                raise ProfileError(
                    f"{rep} is an Nsight report and nsys is not on this PATH: export it where nsys is ({cmd})"
                )
            if problem := export(nsys, rep.with_suffix("")):
                raise ProfileError(problem)
    if path_kind(path) != "file":
        raise ProfileError(f"{path} is a directory: give the export in it, or the directory as PROFILE=")
    try:  # the header only, through the guard (sqlite3 opens the file itself): an export is often gigabytes
        with jsonio.open_regular(path) as f:
            head = f.read(16)
    except jsonio.Unreadable as exc:
        raise ProfileError(str(exc)) from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not head:
        raise ProfileError(
            f"{path} is empty: export the report again ({EXPORT.format(sqlite=path, rep='<.nsys-rep>')})"
        )
    if head != SQLITE_MAGIC:
        raise ProfileError(f"{path} is not an SQLite file: give the export of `nsys export --type sqlite`")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
            return _load(con, path)
    except sqlite3.DatabaseError as exc:
        raise ProfileError(f"{path} is corrupt ({exc}): export the report again") from None


def _need(con, path: Path, table: str, cols: tuple[str, ...]) -> bool:
    """Whether `table` is there; a table that is there without the columns Nsight writes is a wrong schema."""
    if not (have := {row[1] for row in con.execute(f"PRAGMA table_info({table})")}):
        return False
    if missing := [c for c in cols if c not in have]:
        raise ProfileError(f"{path}: {table} lacks {', '.join(missing)}: {NOT_NSYS}")
    return True


NOT_NSYS = "not an Nsight Systems SQLite export (nsys export --type sqlite)"
KERNEL_COLS = ("start", "end", "deviceId", "streamId", "correlationId", "demangledName")
MEMCPY_COLS = ("start", "end", "deviceId", "streamId", "correlationId", "bytes", "copyKind")


def _load(con, path: Path) -> Profile:
    if not _need(con, path, "StringIds", ("id", "value")):
        raise ProfileError(f"{path} has no StringIds table: {NOT_NSYS}")
    if not _need(con, path, "CUPTI_ACTIVITY_KIND_KERNEL", KERNEL_COLS):
        raise ProfileError(f"{path} has no GPU kernels: profile with CUDA tracing on (nsys profile --trace=cuda,nvtx)")
    names = {i: v if isinstance(v, str) else _text(v) for i, v in con.execute("SELECT id, value FROM StringIds")}

    def name(n) -> str:
        return names.get(n) or f"<string {_text(n)}>"

    kernel_sql = _checked(con, path, "CUPTI_ACTIVITY_KIND_KERNEL", KERNEL_COLS, lambda row: name(row[5]))
    new = tuple.__new__  # every row checked: each built as a tuple at C speed (NamedTuple._make's own call)
    kernels = [
        new(Activity, (s, e, d, st, names.get(n) or name(n), c if type(c) is int else -1, None, None, ""))
        for s, e, d, st, c, n in con.execute(kernel_sql)
    ]
    if not kernels:
        raise ProfileError(f"{path} holds no kernel: the profiled window ran nothing on the GPU (check NSYS=a:b)")
    memcpys = []
    if _need(con, path, "CUPTI_ACTIVITY_KIND_MEMCPY", MEMCPY_COLS):
        memcpy_sql = _checked(con, path, "CUPTI_ACTIVITY_KIND_MEMCPY", MEMCPY_COLS, lambda row: f"memcpy kind {row[6]}")
        memcpys = [
            new(Activity, (s, e, d, st, f"memcpy kind {k}", c if type(c) is int else -1, k, b, ""))
            for s, e, d, st, c, b, k in con.execute(memcpy_sql)
        ]
    prof = Profile(path, kernels, memcpys)
    if _need(con, path, "CUPTI_ACTIVITY_KIND_RUNTIME", ("start", "globalTid", "correlationId")):
        rows = con.execute(_RUNTIME).fetchall()  # (start, globalTid, correlationId): the row is the value
        prof.launches = dict(zip(map(operator.itemgetter(2), rows), rows, strict=True))
    if _need(con, path, "NVTX_EVENTS", ("start", "end", "eventType", "text", "textId", "globalTid")):
        rows = con.execute(_NVTX.format(kinds=",".join(map(str, NVTX_RANGES))))
        prof.ranges = [Range(s, e, _text(t) if t is not None else names.get(i, ""), g) for s, e, t, i, g in rows]
    if _need(con, path, "TARGET_INFO_GPU", ("id", "name")):
        prof.gpus = [_text(n) for (n,) in con.execute("SELECT name FROM TARGET_INFO_GPU ORDER BY id")]
    return prof


def _checked(con, path: Path, table: str, cols: tuple[str, ...], name_of) -> str:
    """The SELECT of `table`'s `cols`, once SQLite has looked in one pass for a row activity() would refuse (not
    whole integers, or out of order or range): the first one raises, named by `name_of(row)`."""
    select = f"SELECT {', '.join(cols)} FROM {table}"
    whole = " AND ".join(f"typeof({c}) = 'integer'" for c in ("start", "end", "deviceId", "streamId"))
    for row in con.execute(f"{select} WHERE NOT ({whole} AND 0 <= start AND start <= end AND end <= {MAX_NS}) LIMIT 1"):
        activity(path, *row[:4], name_of(row), row[4])
    return select


def _text(v) -> str:
    """A text cell as text: a BLOB (or a number) where Nsight writes TEXT is decoded, never a traceback."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


_RUNTIME = "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"
_NVTX = (
    "SELECT start, end, text, textId, globalTid FROM NVTX_EVENTS "
    "WHERE eventType IN ({kinds}) AND end IS NOT NULL AND end > start"
)

# The rank of a per-rank file, from its name: Bridge's and our launch name each rank's report with its global rank
# (…rank3.sqlite, …_3.sqlite, Bridge's PyTorch profiler rank-3.json.gz); a name without one takes its place in the
# sorted list. PyTorch traces record their rank (distributedInfo.rank), which wins.
_RANK = re.compile(r"(?:rank[_-]?|_|-)(\d+)$", re.IGNORECASE)
TRACE_SUFFIXES = (".json", ".json.gz")  # PyTorch profiler traces: Kineto's Chrome-trace JSON, gzipped by Bridge


def rank_of(path: Path) -> int | None:
    name = Path(path).name
    for suffix in (*TRACE_SUFFIXES, ".pt.trace"):
        name = name.removesuffix(suffix)
    m = _RANK.search(Path(name).stem if name.endswith((".sqlite", ".nsys-rep")) else name)
    return int(m.group(1)) if m else None


def is_trace(path: Path) -> bool:
    return Path(path).name.endswith(TRACE_SUFFIXES)


def path_kind(path: Path) -> str:
    """ "file" or "dir": `path` stat'ed (following links), or one line saying why it cannot be read. A file must
    pass the project's one guard for planted files (jsonio.open_regular: a regular file, opened without blocking):
    a FIFO or a device would block the reader for ever."""
    try:
        st = os.stat(path)
    except OSError as exc:
        why = "a symbolic link loop" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        if exc.errno == errno.ENOENT:
            why = "no such file or directory"
        raise ProfileError(f"PROFILE={path}: {why}") from None
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    try:
        jsonio.open_regular(path).close()
    except FileNotFoundError:
        raise ProfileError(f"PROFILE={path}: no such file or directory") from None
    except jsonio.Unreadable as exc:
        raise ProfileError(f"PROFILE={path} {exc.what}") from None
    return "file"


def profile_files(target: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    """The per-rank profiles a PROFILE= names: the file, or every *.sqlite (and unexported *.nsys-rep) and every
    PyTorch-profiler trace (*.json, *.json.gz) in the directory, sorted; `skip`: names that are not profiles (the
    report's own JSON)."""
    target = Path(target)
    if path_kind(target) == "file":
        return [target]
    if (target / PLAN).exists():  # a run directory: its profiles are in its nsys/ or torch_profile/, read by RUN=
        raise ProfileError(f"PROFILE={target} is a run directory (it holds {PLAN}): give RUN={target}")
    sqlite = sorted(target.glob("*.sqlite"))
    reps = [r for r in sorted(target.glob("*.nsys-rep")) if r.with_suffix(".sqlite") not in sqlite]
    traces = sorted(p for p in target.iterdir() if is_trace(p) and p.name not in skip)
    files = sqlite + reps + traces
    if not files:
        raise ProfileError(
            f"{target} holds no *.sqlite, *.nsys-rep or PyTorch-profiler trace (*.json, *.json.gz): "
            "put the profiles into it first"
        )
    for f in files:
        path_kind(f)  # a FIFO or a loop among them: one line, before anything is read
    return files


def load(path: Path) -> Profile:
    if is_trace(path):
        from overlapkit.profile import torch_trace

        return torch_trace.read(Path(path))
    return read(path)
