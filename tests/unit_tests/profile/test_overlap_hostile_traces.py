"""The overlap report against hostile PyTorch-profiler traces and PNG= destinations (issue 43, the sweep's area 1:
T012-T016, T028-T031, T058, T062, T063, T072, T073, T079), as a user types `make overlap-report` (the Makefile's own
command line, in this process): each one line naming the fix, exit 2, nothing written, in seconds; trace text
reaches the terminal escaped; the picture goes where the report's JSON goes and never replaces the user's file."""

from __future__ import annotations

import gzip
import json
import time

import pytest
from nsys_fixtures import GEMM, RS

from overlapkit import jsonio
from overlapkit.profile import torch_trace
from overlapkit.profile.nsys_sqlite import ProfileError

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"  # TP1 PP1 CP2 DP4: a good trace exits 1 (no CP kernel), bad input 2
ESC = "mscclpp_allreduce\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED"


def trace_text(ts="100.5", ann_ts="0", ann_tid="1", launch_tid="1", dev_id="0", name=GEMM) -> str:
    """A small valid Kineto trace as JSON text, with the given fields spliced in as raw JSON (so that numbers no
    json.dumps writes, 1e999999999 or a 5001-digit integer, can be planted)."""
    ev = [
        f'{{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": {ann_ts}, "dur": 5000, '
        f'"tid": {ann_tid}}}',
        f'{{"ph": "X", "cat": "kernel", "name": {json.dumps(name)}, "ts": {ts}, "dur": 50.5, "tid": 7, '
        '"args": {"device": 0, "stream": 7, "correlation": 1}}',
        f'{{"ph": "X", "cat": "kernel", "name": "{RS}", "ts": 120.0, "dur": 60, "tid": 9, '
        '"args": {"device": 0, "stream": 9, "correlation": 2, "Process Group Description": "DATA_PARALLEL_GROUP"}}',
    ]
    for c in (1, 2):
        ev.append(
            f'{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": {c}, "dur": 1, '
            f'"tid": {launch_tid}, "args": {{"correlation": {c}}}}}'
        )
    props = f'[{{"id": {dev_id}, "name": "NVIDIA H100 80GB HBM3"}}]'
    return f'{{"distributedInfo": {{"rank": 0}}, "deviceProperties": {props}, "traceEvents": [{", ".join(ev)}]}}'


# case → (trace fields, what the one line says)
BAD = {
    "T012 ts 1e999999999": ({"ts": "1e999999999"}, "1e999999999 is out of range"),
    "T013 ts 9e999990": ({"ts": "9e999990"}, "9e999990 is out of range"),
    "T014 ts the string Infinity": ({"ts": '"Infinity"'}, "has start None, not an integer"),
    "T016 ts of 5001 digits": ({"ts": "9" * 5001}, "out of range (int64)"),
    "T029 annotation tid a list": (
        {"ann_tid": "[1, 2]"},
        "the tid of user_annotation event 'ProfilerStep#1' is [1, 2]",
    ),
    "T030 launch tid an object": ({"launch_tid": '{"a": 1}'}, "the tid of cuda_runtime event"),
    "T031 deviceProperties id a list": ({"dev_id": "[0]"}, "deviceProperties[0].id is [0]"),
    "T072 annotation ts 9e999990": ({"ann_ts": "9e999990"}, "9e999990 is out of range"),
    # variants: a finite exponent past any clock, a long text, a negative time, a time past 2^62 ns
    "ts 1e300": ({"ts": "1e300"}, "past 2^62 ns"),
    "annotation ts 1e300": ({"ann_ts": "1e300"}, "past 2^62 ns"),
    "ts of 60 characters": ({"ts": "0." + "0" * 57 + "1"}, "has 60 characters"),
    "ts negative": ({"ts": "-5.5"}, "has a negative time"),
    "annotation ts 2^63 ns": ({"ann_ts": str(2**63 // 1000)}, "outside 0..2^62 ns"),
    "annotation ts NaN": ({"ann_ts": "NaN"}, "NaN is not a number"),
    "name a list": ({"name": ["a"]}, "the name of a kernel event is ['a']"),
}


def _profile(tmp_path, text: str, name="rank-0.json"):
    (d := tmp_path / "prof").mkdir()
    (d / name).write_text(text) if isinstance(text, str) else (d / name).write_bytes(text)
    return d


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def report(planned, tmp_path, monkeypatch, make_here):
    """`make overlap-report PROFILE=<dir> RECIPE=R8 ...` from a folder of its own; returns (status, out, err, s)."""
    planned(R8)  # Bridge imported once, as a served make would have it
    (cwd := tmp_path / "cwd").mkdir()
    monkeypatch.chdir(cwd)

    def run(*variables):
        t0 = time.perf_counter()
        code, out, err = make_here("overlap-report", f"RECIPE={R8}", *variables)
        return code, out, err, time.perf_counter() - t0

    return run


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_hostile_trace_is_one_line_exit_2_in_seconds_nothing_written(report, tmp_path, case):
    fields, needle = BAD[case]
    prof = _profile(tmp_path, trace_text(**fields))
    before = _tree(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ProfileError) as exc:
        torch_trace.read(prof / "rank-0.json")
    assert time.perf_counter() - t0 < 3, case  # was 36 s per 9e999990
    code, out, err, _ = report(f"PROFILE={prof}")
    assert code == 2 and out == "" and err.count("\n") == 1, (case, err)
    assert needle in err and "rank-0.json" in err and "profile the run again" in err, err
    assert "set_int_max_str_digits" not in err and needle in str(exc.value)
    assert _tree(tmp_path) == before  # no picture, no report


def test_the_fixture_trace_itself_is_good(report, tmp_path):
    """The base of every case above reports (exit 1: the plan's CP has no kernel), so each case fails on its field."""
    code, out, err, _ = report(f"PROFILE={_profile(tmp_path, trace_text())}", "FORMAT=json")
    assert code == 1 and json.loads(out)["classes"]["dp"]["kernels"] == 1, err
    assert torch_trace.ns(torch_trace.Num("1e-999999")) == 0  # a tiny exponent costs nothing either


def test_T073_a_gzip_bomb_is_refused_at_the_ceiling_not_unpacked_whole(report, tmp_path, monkeypatch):
    """The trace is read through jsonio.read_bytes with TRACE_LIMIT: unpacking stops at the ceiling (lowered here
    to 1 MiB so that the test unpacks 1 MiB, not 2 GiB)."""
    monkeypatch.setattr(jsonio, "TRACE_LIMIT", jsonio.MiB)
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (64 * jsonio.MiB) + b"]}", compresslevel=9)
    assert len(bomb) < 100_000
    prof = _profile(tmp_path, bomb, "rank-0.json.gz")
    code, out, err, took = report(f"PROFILE={prof}")
    assert code == 2 and err.count("\n") == 1 and "unpacks to more than 1 MiB" in err and took < 20, err


def test_T079_a_run_directory_as_profile_says_give_run(report, tmp_path):
    (run := tmp_path / "run").mkdir()
    (run / "plan.json").write_text("{}")
    (run / "ledger.json").write_text("{}")
    code, _, err, _ = report(f"PROFILE={run}")
    assert code == 2 and err.count("\n") == 1 and f"is a run directory (it holds plan.json): give RUN={run}" in err


def test_T028_trace_text_reaches_the_terminal_escaped(report, tmp_path):
    """A kernel name with OSC (set title), CSI (clear screen, colour) and BEL: shown as \\x1b..., never acted on,
    on stdout (the report) and stderr (the error lines); JSON escapes it too."""
    prof = _profile(tmp_path, trace_text(name=ESC))
    for fmt in ("text", "json"):
        code, out, err, _ = report(f"PROFILE={prof}", f"FORMAT={fmt}")
        assert code == 1 and "\x1b" not in out + err and "\x07" not in out + err, (out, err)
        if fmt == "text":
            assert "mscclpp_allreduce\\x1b]0;PWNED\\x07\\x1b[2J\\x1b[31mRED" in out
        else:
            assert json.loads(out)["unknown_comm"][0]["name"] == ESC


# --- the picture ---------------------------------------------------------------------------------------------------


def test_the_png_goes_to_the_current_folder_never_beside_the_profiles(report, tmp_path):
    prof = _profile(tmp_path, trace_text())
    before = _tree(prof)
    code, out, err, _ = report(f"PROFILE={prof}")
    png = tmp_path / "cwd" / "overlap_timeline.png"
    assert code == 1 and png.read_bytes()[:4] == b"\x89PNG" and f"timeline: {png}" in out, err
    assert _tree(prof) == before  # the profiles' folder (shared, or read-only) untouched
    code, _, err, _ = report(f"PROFILE={prof}")  # its own picture: replaced without FORCE
    assert code == 1 and "error: [cp_overlap_unmeasured]" in err


def test_T058_png_never_replaces_the_users_file_without_force(report, tmp_path):
    prof = _profile(tmp_path, trace_text())
    (mine := tmp_path / "existing.png").write_text("the user's own file")
    code, out, err, _ = report(f"PROFILE={prof}", f"PNG={mine}")
    assert code == 2 and out == "" and err.count("\n") == 1 and "FORCE=1" in err and "not a timeline" in err
    assert mine.read_text() == "the user's own file" and not (tmp_path / "cwd" / "overlap_timeline.png").exists()
    code, _, err, _ = report(f"PROFILE={prof}", f"PNG={mine}", "FORCE=1")
    assert code == 1 and mine.read_bytes()[:4] == b"\x89PNG", err
    code, _, err, _ = report(f"PROFILE={prof}", f"PNG={mine}")  # now the command's own: replaced again
    assert code == 1, err
    code, _, err, _ = report(f"PROFILE={prof}", f"PNG={mine}", "FORCE=maybe")
    assert code == 2 and "--force" in err and err.count("\n") == 1


@pytest.mark.parametrize("png", [".png", "sub/.PNG", "x.txt", "dir/", "noext"])
def test_T062_T063_a_png_name_without_a_name_before_the_suffix_is_one_line(report, tmp_path, png):
    prof = _profile(tmp_path, trace_text())
    before = _tree(tmp_path)
    code, out, err, _ = report(f"PROFILE={prof}", f"PNG={png}")
    assert code == 2 and out == "" and err.count("\n") == 1 and "ending in .png" in err, err
    assert _tree(tmp_path) == before


def test_png_a_directory_is_one_line(report, tmp_path):
    prof = _profile(tmp_path, trace_text())
    (tmp_path / "d.png").mkdir()
    code, _, err, _ = report(f"PROFILE={prof}", f"PNG={tmp_path / 'd.png'}", "FORCE=1")
    assert code == 2 and err.count("\n") == 1 and "is a directory" in err
