"""The overlap report on Nsight SQLite exports built to the documented schema (nsys_fixtures.py): exposed time per
class to the microsecond, every classification rule, the plan's claims, a profile of another layout, bad files in
one line each, and the interval arithmetic against a brute-force sweep. Real plans (the session's `planned`)."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess

import pytest
from nsys_fixtures import (
    AG,
    BCAST,
    DEEPEP_COMBINE,
    DEEPEP_DISPATCH,
    GEMM,
    P2P,
    RS,
    SENDRECV,
    STEP,
    UB_RS,
    UB_SEND,
    K,
    dense_step,
    write,
)

from overlapkit import paths
from overlapkit.nightly import exposed
from overlapkit.profile import nsys_sqlite, overlap_claims, overlap_classes, overlap_render, overlap_report, profiled
from overlapkit.profile.nsys_sqlite import ProfileError

R70 = "llama3_70b_pretrain_64gpu_h100_bf16"  # TP4 (userbuffers) PP4 CP2 VPP5 DP2
R235 = "qwen3_235b_a22b_pretrain_256gpu_h100_bf16"  # TP2 (userbuffers off) PP8 VPP4 EP32, alltoall, EP overlap on
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"  # TP1 PP1 CP2 DP4


def test_a_dense_rank_to_the_microsecond(planned, tmp_path):
    plan = planned(R70).to_dict()
    rep = overlap_report.report_profiles([dense_step(tmp_path)], plan)
    c = rep["classes"]
    assert c["tp"] == {"comm_ms": 0.24, "hidden_ms": 0.14, "exposed_ms": 0.1, "exposed_share": 0.4167, "kernels": 4}
    assert c["cp"] == {"comm_ms": 0.05, "hidden_ms": 0.05, "exposed_ms": 0.0, "exposed_share": 0.0, "kernels": 1}
    assert c["pp"] == {"comm_ms": 0.08, "hidden_ms": 0.0, "exposed_ms": 0.08, "exposed_share": 1.0, "kernels": 1}
    assert c["dp"] == {"comm_ms": 0.2, "hidden_ms": 0.15, "exposed_ms": 0.05, "exposed_share": 0.25, "kernels": 2}
    assert c["ep"]["kernels"] == 0 and rep["unclassified"] is None
    r0 = rep["ranks"]["0"]
    assert r0["steps"] == {"source": "nvtx", "count": 2} and rep["window"]["step_sources"] == ["nvtx"]
    assert [s["span_ms"] for s in r0["per_step"]] == [0.98, 0.5]  # first start to last end of what each step launched
    assert r0["per_step"][0]["dp"]["exposed_ms"] == 0.05 and r0["per_step"][1]["dp"]["exposed_ms"] == 0.0
    rules = {(r["class"], r["rule"].split(":")[0]) for r in rep["rules"]}
    assert rules == {("tp", "name"), ("tp", "plan"), ("tp", "stream"), ("cp", "nvtx"), ("pp", "nvtx"), ("dp", "stream")}
    # The claims: TP 41.7% ≤ 50%, DP 25% ≤ 50%, CP hidden; PP fully exposed with overlap_p2p_comm on.
    assert [(f["code"], f["level"]) for f in rep["findings"]] == [("pp_overlap_exposed", "error")]
    assert "overlap_p2p_comm" in rep["findings"][0]["message"] and rep["findings"][0]["fix"]
    png = overlap_report.timeline_png(
        overlap_report.measure(nsys_sqlite.profile_files(tmp_path), plan), tmp_path / "t.png"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.fixture(scope="module")
def tp2_plan():
    """The 70B recipe planned at TP=2 (a real plan: userbuffers on, Bridge keeps it; its audit names the TP4 preset
    as a mismatch, which is the plan's business, not the report's)."""
    from overlapkit.bridge.build import make_plan

    return make_plan(R70, sets="model.tensor_model_parallel_size=2", caller_env={}).to_dict()


def test_tp2_userbuffers_that_hide_nothing_fail_the_claim(tp2_plan, tmp_path):
    acts = [
        K(GEMM, 0, 100),
        K(UB_SEND, 100, 150, stream=30),  # after the GEMM: exposed
        K("memcpy", 120, 180, stream=31, copy=True),  # the ring exchange's copy-engine transfer: exposed
        K(SENDRECV, 50, 130, stream=40),  # CP's K/V ring, outside every p2p range: 50 hidden, 30 exposed
        K(SENDRECV, 190, 200, stream=50, launch=185),
    ]
    write(tmp_path / "rank0.sqlite", acts, [(P2P, 180, 188)])
    rep = overlap_report.report_profiles([tmp_path], tp2_plan)
    assert rep["layout"]["tp"] == 2 and tp2_plan["audit"]["rows"]["tp_comm_overlap"]["state"] == "on"
    assert rep["classes"]["tp"] == {
        "comm_ms": 0.08,
        "hidden_ms": 0.0,
        "exposed_ms": 0.08,
        "exposed_share": 1.0,
        "kernels": 2,
    }
    assert rep["classes"]["cp"]["exposed_ms"] == 0.03 and rep["classes"]["cp"]["hidden_ms"] == 0.05
    tp = next(f for f in rep["findings"] if f["code"] == "tp_overlap_exposed")
    assert tp["level"] == "error" and "100.0%" in tp["message"] and "userbuffers" in tp["fix"]
    assert "cp_overlap_exposed" not in {f["code"] for f in rep["findings"]}


def moe_rank(tmp_path, rank: int, ep_end: float, nvtx: bool = True):
    """A 235B rank: a GEMM 0-500; PP p2p (in Megatron's p2p range) 500-520, exposed; EP all-to-all SendRecv on
    another stream 450-`ep_end`; a userbuffers kernel 100-150 (hidden) although the plan has TP overlap off."""
    acts = [
        K(GEMM, 0, 500),
        K(SENDRECV, 500, 520, stream=50, launch=480),
        K(SENDRECV, 450, ep_end, stream=70, launch=300),
        K(UB_SEND, 100, 150, stream=30),
    ]
    ranges = [(STEP, -10, 600), (P2P, 470, 490)] if nvtx else []
    return write(tmp_path / f"rank{rank}.sqlite", acts, ranges)


def test_moe_ranks_tell_pp_from_ep_by_nvtx(planned, tmp_path):
    plan = planned(R235).to_dict()
    moe_rank(tmp_path, 2, 500)  # EP 450-500: hidden
    moe_rank(tmp_path, 10, 700)  # EP 450-700: 50 hidden, 200 exposed
    rep = overlap_report.report_profiles([tmp_path], plan)
    assert list(rep["ranks"]) == ["2", "10"]  # by rank, not by file name
    assert rep["ranks"]["10"]["classes"]["ep"]["exposed_ms"] == 0.2
    assert rep["ranks"]["2"]["classes"]["ep"]["exposed_ms"] == 0
    assert rep["classes"]["ep"] == {
        "comm_ms": 0.3,
        "hidden_ms": 0.1,
        "exposed_ms": 0.2,
        "exposed_share": 0.6667,
        "kernels": 2,
    }
    assert rep["classes"]["pp"]["exposed_ms"] == 0.04 and rep["classes"]["tp"]["hidden_ms"] == 0.1
    decided = {r["rule"] for r in rep["rules"] if r["class"] in ("pp", "ep")}
    assert any("launched in range" in r and P2P in r for r in decided)
    assert any("outside every pipeline_parallel.p2p_communication range" in r for r in decided)
    codes = {f["code"]: f["level"] for f in rep["findings"]}
    assert codes == {
        "ep_overlap_exposed": "error",
        "pp_overlap_exposed": "error",
        "tp_hidden_while_off": "warning",
        "dp_overlap_unmeasured": "error",  # DP16 claims its overlaps, and no DP kernel is in these profiles
    }


def test_what_no_rule_decides_is_reported_unclassified(planned, tmp_path):
    moe_rank(tmp_path, 0, 600, nvtx=False)
    rep = overlap_report.report_profiles([tmp_path], planned(R235).to_dict())
    assert rep["unclassified"]["kernels"] == 2 and rep["unclassified"]["candidates"] == {"pp or ep": 2}
    assert rep["unclassified"]["comm_ms"] == 0.15 and rep["window"]["step_sources"] == ["window"]
    warn = next(f for f in rep["findings"] if f["code"] == "unclassified_comm")
    assert warn["level"] == "warning" and "profiling.nvtx_ranges=true" in warn["fix"]
    assert "unclassified" in overlap_render.table(rep).columns[1]._cells


def test_a_profile_of_another_layout_is_reported(planned, tmp_path):
    acts = [K(GEMM, 0, 100), K(UB_RS, 50, 150, stream=30), K(DEEPEP_DISPATCH, 10, 20, stream=80)]
    write(tmp_path / "rank12.sqlite", acts)
    rep = overlap_report.report_profiles([tmp_path], planned(R8).to_dict())  # TP1, no experts, 8 GPUs
    got = {(f["code"], f["message"].split(" ")[0]) for f in rep["findings"]}
    assert ("class_not_in_plan", "TP") in got and ("class_not_in_plan", "EP") in got
    assert ("profile_mismatch", "profiled") in got
    assert all(f["level"] == "error" for f in rep["findings"])


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (AG, "AllGather"),
        (RS, "ReduceScatter"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "AllReduce"),  # NCCL <= 2.18
        (SENDRECV, "SendRecv"),
        (BCAST, "Broadcast"),
        (UB_RS, "userbuffers"),
        (UB_SEND, "userbuffers"),
        (DEEPEP_DISPATCH, "deepep"),
        (DEEPEP_COMBINE, "deepep"),
        (
            "void hybrid_ep::dispatch_kernel<hybrid_ep::dispatch_config_t<8>>(hybrid_ep::dispatch_kernel_param_t)",
            "deepep",
        ),
        (GEMM, None),
    ],
)
def test_kernel_names_by_source(name, kind):
    assert overlap_classes.kind_of(nsys_sqlite.Activity(0, 1, 0, 7, name, 1)) == kind


def test_thresholds_have_reasons_and_the_bubble_widens_pp():
    assert set(overlap_claims.THRESHOLDS) == set(overlap_classes.CLASSES)
    assert all(0 < t < 1 and len(why) > 30 for t, why in overlap_claims.THRESHOLDS.values())
    plan = {"layout": {"pp": 8, "vpp": 1, "gbs": 256, "mbs": 1, "dp": 4}}  # 64 micro-batches: bubble 7/64
    assert overlap_claims.threshold("pp", plan) == pytest.approx(0.5 + 7 / 64)
    plan["layout"]["gbs"] = 32  # 8 micro-batches: the bubble would allow 94%; never above 90%
    assert overlap_claims.threshold("pp", plan) == 0.9


def _sqlite(path, sql):
    con = sqlite3.connect(path)
    con.executescript(sql)
    con.close()
    return path


BAD = {
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "not sqlite": (lambda p: p.write_text("==PROF== nsys report\n"), "is not an SQLite file"),
    "corrupt": (lambda p: p.write_bytes(nsys_sqlite.SQLITE_MAGIC + b"\x10\x00" + b"\xff" * 600), "is corrupt"),
    "foreign sqlite": (lambda p: _sqlite(p, "CREATE TABLE t (x);"), "no StringIds table"),
    "no kernel table": (lambda p: _sqlite(p, "CREATE TABLE StringIds (id, value);"), "has no GPU kernels"),
    "wrong columns": (
        lambda p: _sqlite(
            p, "CREATE TABLE StringIds (id, value); CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start, end);"
        ),
        "lacks deviceId, streamId, correlationId, demangledName",
    ),
    "no kernels": (lambda p: write(p, []), "holds no kernel"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_one_line(tmp_path, case):
    make, needle = BAD[case]
    make(path := tmp_path / "rank0.sqlite")
    with pytest.raises(ProfileError) as err:
        nsys_sqlite.read(path)
    assert needle in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)


def test_an_nsys_rep_without_nsys_names_the_export(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    (rep := tmp_path / "rank0.nsys-rep").write_bytes(b"\x00")
    with pytest.raises(
        ProfileError, match=r"nsys is not on this PATH: export it where nsys is \(nsys export --type sqlite"
    ):
        nsys_sqlite.read(rep)
    assert nsys_sqlite.profile_files(tmp_path) == [rep]


def fake_nsys(bin_dir, body: str) -> None:
    """An `nsys` on the PATH (none exists on a CPU machine): `nsys export --type=sqlite ... --output=OUT REP` runs body
    with $out set to OUT."""
    bin_dir.mkdir()
    (script := bin_dir / "nsys").write_text(
        f'#!/bin/sh\nfor a; do case $a in --output=*) out="${{a#--output=}}";; esac; done\n{body}\n'
    )
    script.chmod(0o755)


def test_an_nsys_rep_is_exported_where_nsys_is_on_the_path(planned, tmp_path, monkeypatch):
    dense_step(tmp_path, "made.sqlite")
    fake_nsys(tmp_path / "bin", f'cp {tmp_path / "made.sqlite"} "$out"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    (prof := tmp_path / "my profiles").mkdir()  # a space in the path is one argument to nsys
    (rep := prof / "profile_1_2_node0_rank3.nsys-rep").write_bytes(b"\x00")
    got = overlap_report.report_profiles([prof], planned(R70).to_dict())
    assert list(got["ranks"]) == ["3"] and got["classes"]["pp"]["exposed_ms"] == 0.08
    assert rep.with_suffix(".sqlite").is_file() and nsys_sqlite.profile_files(prof) == [rep.with_suffix(".sqlite")]
    (rep2 := prof / "rank4.nsys-rep").write_bytes(b"\x00")
    fake_nsys(tmp_path / "bin2", "echo 'ERROR: report file is damaged' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin2'}:/usr/bin:/bin")
    with pytest.raises(
        ProfileError, match=r"nsys export of .*/my profiles/rank4.nsys-rep failed \(ERROR: report file is damaged\)"
    ):
        nsys_sqlite.read(rep2)


def test_run_directory_reads_plan_and_nsys(planned, tmp_path, make_here):
    run = tmp_path / "run"
    (run / "nsys").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps(planned(R70).to_dict(), default=str))
    dense_step(run / "nsys")
    assert (
        overlap_report.report_of(overlap_report.measure(*overlap_report.run_inputs(run)))["classes"]["pp"]["exposed_ms"]
        == 0.08
    )
    code, out, err = make_here("overlap-report", f"RUN={run}", "FORMAT=json")
    assert code == 1 and json.loads(out)["classes"]["dp"]["exposed_share"] == 0.25
    assert (run / "overlap_timeline.png").is_file() and (run / "overlap_report.json").is_file()
    assert err.startswith("error: [pp_overlap_exposed]")
    made = json.loads((run / "overlap_report.json").read_text())
    (run / "overlap_report.json").unlink()
    assert profiled.write_overlap(run) is None  # what the job's first profiled rank calls (profile/profiled.py)
    assert json.loads((run / "overlap_report.json").read_text()) == made  # the same file under the same names
    report, why = exposed.read(run)  # and what the nightly reads
    assert why is None and exposed.shares(report) == {"tp": 0.4167, "cp": 0.0, "pp": 1.0, "dp": 0.25}
    (run / "nsys" / "rank0.sqlite").write_bytes(b"garbage")
    code, out, err = make_here("overlap-report", f"RUN={run}")
    assert code == 2 and out == "" and err.count("\n") == 1 and "is not an SQLite file" in err
    code, _, err = make_here("overlap-report", f"RUN={tmp_path / 'nowhere'}")
    assert code == 2 and f"{tmp_path / 'nowhere' / 'plan.json'}: no such file" in err


def _brute(a, b):
    cover = lambda ivs: {t for s, e in ivs for t in range(s, e)}  # noqa: E731
    return cover(a) - cover(b)


def test_interval_arithmetic_matches_a_brute_force_sweep():
    rng = random.Random(24)  # seeded: hypothesis is not in the pinned stack
    for _ in range(400):
        a = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 200) for _ in range(rng.randint(0, 12)))]
        b = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 200) for _ in range(rng.randint(0, 12)))]
        ua, ub = overlap_report.union(a), overlap_report.union(b)
        assert {t for s, e in ua for t in range(s, e)} == _brute(a, [])
        assert all(x[1] < y[0] for x, y in zip(ua, ua[1:], strict=False))  # disjoint, not touching, sorted
        diff = overlap_report.subtract(ua, ub)
        assert {t for s, e in diff for t in range(s, e)} == _brute(a, b)
        assert overlap_report.length(diff) == len(_brute(a, b))


def make(*args):
    cmd = ["make", "overlap-report", *args]
    return subprocess.run(cmd, cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=600)


def test_make_overlap_report_end_to_end(tmp_path):
    """As a user types it, in new processes (served where the plan server is on): the 70B plan made from RECIPE=,
    the fixture's figures to the microsecond, exit 1 for the exposed PP claim (make's `Error 1`), a bad file in one
    line with `Error 2`."""
    dense_step(tmp_path, "profile_1_2_node0_rank4.sqlite")
    png = f"PNG={tmp_path / 'out' / 'timeline.png'}"  # the default is make's folder, the checkout: not in a test
    out = make(f"RECIPE={R70}", f"PROFILE={tmp_path}", "FORMAT=json", png)
    rep = json.loads(out.stdout)
    assert out.returncode == 2 and "Error 1" in out.stderr, out.stderr
    assert [r for r in rep["ranks"]] == ["4"] and rep["recipe"] == R70
    assert {c: (v["comm_ms"], v["exposed_ms"]) for c, v in rep["classes"].items()} == {
        "tp": (0.24, 0.1),
        "cp": (0.05, 0.0),
        "pp": (0.08, 0.08),
        "dp": (0.2, 0.05),
        "ep": (0.0, 0.0),
    }
    assert (tmp_path / "out" / "timeline.png").is_file() and not (tmp_path / "overlap_timeline.png").exists()
    text = make(f"RECIPE={R70}", f"PROFILE={tmp_path}", png)  # its own picture: replaced without FORCE
    assert "pp_overlap_exposed" in text.stdout and "claims: 1 error(s)" in text.stdout
    (bad := tmp_path / "rank9.sqlite").write_bytes(b"")
    out = make(f"RECIPE={R70}", f"PROFILE={bad}")
    ours = [line for line in out.stderr.splitlines() if not line.startswith("make")]
    assert out.returncode == 2 and "Error 2" in out.stderr and len(ours) == 1 and "is empty" in ours[0]


def test_steps_that_overlap_count_each_interval_once(tmp_path):
    """Step 0's tail reduce-scatter 950-1100 runs into step 1 (from 1000): the overlap is step 1's."""
    acts = [K(GEMM, 0, 900), K(RS, 950, 1100, stream=60, launch=940), K(GEMM, 1000, 1500, launch=990)]
    prof = nsys_sqlite.read(write(tmp_path / "r.sqlite", acts, [(STEP, -10, 945), (STEP, 985, 1400)]))
    assert overlap_report.steps_of(prof, 0) == ("nvtx", [(0, 1_000_000), (1_000_000, 1_500_000)])
