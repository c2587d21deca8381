"""The one JSON writer: what it writes reads back, it replaces an old file whole, and it leaves no temp file; the
reader: lenient, the object or None for anything else; strict (a role given), one line for each way a file is wrong."""

from __future__ import annotations

import json
import os

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
