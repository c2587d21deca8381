"""The one JSON writer: what it writes reads back, it replaces an old file whole, and it leaves no temp file; the
reader: lenient, the object or None for anything else; strict (a role given), one line for each way a file is wrong."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from overlapkit import jsonio
from overlapkit.errors import BadInput


def test_write_reads_back_and_replaces_whole(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"old": true, "long": "' + "x" * 1000 + '"}')
    assert jsonio.write_json(path, {"a": [1, 2], "b": "é"}) == path
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": "é"} and path.read_text().endswith("}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_unserialisable_data_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "night.json"
    jsonio.write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        jsonio.write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": 1}


def test_read_json_is_the_object_or_none(tmp_path):
    path = tmp_path / "submission.json"
    assert jsonio.read_json(path) is None  # not there yet
    jsonio.write_json(path, {"state": "submitted", "job_id": "7"})
    assert jsonio.read_json(path) == {"state": "submitted", "job_id": "7"}
    path.write_text('{"state": "subm')  # half written by a writer that is not write_json
    assert jsonio.read_json(path) is None
    path.write_bytes(b"\xff\xfe")  # not text
    assert jsonio.read_json(path) is None
    path.write_text("[1, 2]")  # JSON, but no object to read fields from
    assert jsonio.read_json(path) is None
    assert jsonio.read_json(tmp_path) is None  # a directory: unreadable


def test_read_json_with_a_role_says_what_the_file_is_whats_wrong_and_the_fix(tmp_path):
    path, role, fix = tmp_path / "night.json", "the night's record", "give NIGHT=<dir>"

    def said(**kw) -> str:
        with pytest.raises(jsonio.FileProblem) as exc:
            jsonio.read_json(path, role=role, fix=fix, **kw)
        assert "\n" not in str(exc.value) and str(exc.value).endswith(f"; it should be {role}: {fix}")
        return str(exc.value).removesuffix(f"; it should be {role}: {fix}")

    assert said() == f"{path}: no such file"
    assert jsonio.read_json(path, role=role, missing_ok=True) is None
    for raw, what in [
        (b"", "is empty"),
        (b"Expecting", "is not JSON (Expecting value)"),
        (b"\x80\x00binary", "is not text (byte 1 is not UTF-8)"),
        (b"[1]", "holds a list, not an object"),
        (b"null", "holds null, not an object"),
    ]:
        path.write_bytes(raw)
        assert said(missing_ok=True) == f"{path}: {what}"  # missing_ok: only a missing file is None
    path.write_text('{"stamp": 1}')
    assert said(keys=("entries", "stamp", "job_dir")) == f"{path}: lacks 'entries', 'job_dir'"
    assert jsonio.read_json(path, role=role, keys=("stamp",)) == {"stamp": 1}
    with pytest.raises(jsonio.FileProblem, match=r": cannot be read \(Is a directory\); it should be"):
        jsonio.read_json(tmp_path, role=role)


def test_a_lock_file_opens_in_place_and_never_through_a_planted_link(tmp_path):
    lock = tmp_path / "x.lock"
    fd = jsonio.open_lock(lock)
    inode = os.fstat(fd).st_ino
    os.close(fd)
    fd = jsonio.open_lock(lock)  # the same file again (a lock keeps its inode), never replaced
    assert os.fstat(fd).st_ino == inode and lock.stat().st_mode & 0o777 == 0o600 & ~_umask()
    os.close(fd)
    lock.unlink()
    for target in (tmp_path / "precious", tmp_path / "not-yet"):  # an existing file, and a name it would create
        lock.symlink_to(target)
        if target.name == "precious":
            target.write_text("keep")
        with pytest.raises(BadInput, match=f"{lock} is a symbolic link to {target}, never followed: remove it"):
            jsonio.open_lock(lock)
        lock.unlink()
    assert (tmp_path / "precious").read_text() == "keep" and not (tmp_path / "not-yet").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_guarded_reader_refuses_what_would_hang_or_flood_it(tmp_path):
    """A FIFO (open() alone would block for ever), a device, a planted link where none may be, a file past its
    ceiling, a gzip bomb: each one Unreadable line, returned at once."""
    fifo = tmp_path / "submission.json"
    os.mkfifo(fifo)
    with pytest.raises(jsonio.Unreadable, match="not a regular file"):
        jsonio.read_bytes(fifo)
    assert jsonio.read_json(fifo) is None
    with pytest.raises(jsonio.FileProblem, match="not a regular file.*it should be the record"):
        jsonio.read_json(fifo, role="the record")
    with pytest.raises(jsonio.Unreadable, match="not a regular file"):
        jsonio.read_bytes(Path("/dev/zero"))
    real = tmp_path / "real.json"
    real.write_text("{}")
    (tmp_path / "link.json").symlink_to(real)
    assert jsonio.read_bytes(tmp_path / "link.json") == b"{}"
    with pytest.raises(jsonio.Unreadable, match="symbolic link, never followed"):
        jsonio.read_bytes(tmp_path / "link.json", follow=False)
    with pytest.raises(jsonio.Unreadable, match="larger than 1 MiB"):
        jsonio.read_bytes(_write(tmp_path / "big", b"x" * (jsonio.MiB + 1)), jsonio.MiB)
    bomb = _write(tmp_path / "bomb.json.gz", gzip.compress(b"0" * (8 * jsonio.MiB)))
    assert len(bomb.read_bytes()) < 64 * 1024
    with pytest.raises(jsonio.Unreadable, match="unpacks to more than 1 MiB"):
        jsonio.read_bytes(bomb, jsonio.MiB)
    two = _write(tmp_path / "two.gz", gzip.compress(b"ab") + gzip.compress(b"cd"))
    assert jsonio.read_bytes(two) == b"abcd"
    with pytest.raises(jsonio.Unreadable, match="truncated gzip"):
        jsonio.read_bytes(_write(tmp_path / "cut.gz", gzip.compress(b"x" * 1000)[:-12]))
    with pytest.raises(FileNotFoundError):
        jsonio.read_bytes(tmp_path / "absent")


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "text",
    [
        '{"n": 9223372036854775808}',
        '{"n": -9223372036854775809}',
        '{"n": 1' + "0" * 5000 + "}",
        '{"n": 1e999}',
        '{"n": NaN}',
        '{"n": -Infinity}',
    ],
)
def test_strict_numbers_refuse_what_no_record_holds(tmp_path, text):
    """Integers past int64 (checked on the digits: Python's 4,300-digit limit is never reached), infinities, NaN."""
    path = _write(tmp_path / "plan.json", text.encode())
    assert jsonio.read_json(path) is None
    with pytest.raises(jsonio.FileProblem, match=r"plan.json: is not JSON \((the integer|the number|NaN|-Infinity)"):
        jsonio.read_json(path, role="the plan")
    assert jsonio.loads('{"n": 9223372036854775807, "f": 1.5e300}') == {"n": 9223372036854775807, "f": 1.5e300}


def test_a_file_another_tool_writes_may_hold_a_big_integer(tmp_path):
    """Hugging Face writes model_max_length = 1e30 as an integer into tokenizer_config.json: `foreign` takes it (up
    to 64 digits), our own records do not."""
    path = _write(tmp_path / "tokenizer_config.json", b'{"model_max_length": 1000000000000000019884624838656}')
    assert jsonio.read_json(path) is None
    assert jsonio.read_json(path, foreign=True) == {"model_max_length": 1000000000000000019884624838656}
    assert jsonio.read_json(_write(tmp_path / "t.json", b'{"n": 1' + b"0" * 70 + b"}"), foreign=True) is None


def test_a_gzip_bomb_is_refused_by_its_ratio_below_any_ceiling(tmp_path):
    """The sweep's T073 had a 1.5 MB trace unpacking to 1.5 GB, under the 2 GiB trace ceiling: the ratio (gzip packs a
    real profiler trace about 20x, tests/data/reference_traces) stops it after a few MB, memory never near the bomb's
    size; the real traces themselves still read whole."""
    import tracemalloc

    bomb = _write(tmp_path / "rank-0.json.gz", gzip.compress(b"[" + b" " * (256 * jsonio.MiB) + b"]", 9))
    assert len(bomb.read_bytes()) < 400_000
    tracemalloc.start()
    try:
        with pytest.raises(jsonio.Unreadable, match=r"over 100x its size .*a gzip bomb"):
            jsonio.read_bytes(bomb, jsonio.TRACE_LIMIT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 * jsonio.MiB
    real = Path(__file__).parents[1] / "data" / "reference_traces" / "nccl_data.json.gz"
    assert jsonio.loads(jsonio.read_bytes(real, jsonio.TRACE_LIMIT))["traceEvents"]
