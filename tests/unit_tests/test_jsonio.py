"""The one JSON writer: what it writes reads back, it replaces an old file whole, and it leaves no temp file; the
lenient reader: the object, or None for anything else."""

from __future__ import annotations

import json

import pytest

from overlapkit import jsonio


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
