"""The overlap report against careless or hostile input (issue 33's cases in the report's code), in process: every bad
row or file one line naming it, never a traceback, a hang or a write through a planted link; and the new name
families and claims (issue 31)."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
from nsys_fixtures import AG, GEMM, H100, RS, SENDRECV, K, dense_step, write

from overlapkit.profile import nsys_sqlite, overlap_classes, overlap_report
from overlapkit.profile.nsys_sqlite import ProfileError

R70 = "llama3_70b_pretrain_64gpu_h100_bf16"  # TP4 PP4 CP2 VPP5 DP2
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"  # TP1 PP1 CP2 DP4


@pytest.fixture(scope="module")
def r8(planned):
    return planned(R8).to_dict()


def _patch(path, sql, *args):
    """`sql` applied to the export, its kernel table first copied without Nsight's NOT NULL (a hostile file's)."""
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE k AS SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL; DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL; "
        "ALTER TABLE k RENAME TO CUPTI_ACTIVITY_KIND_KERNEL;"
    )
    con.execute(sql, args)
    con.commit()
    con.close()
    return path


ROWS = {
    "null start": ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE correlationId = 100", "has start None"),
    "text start": ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'abc' WHERE correlationId = 100", "has start 'abc'"),
    "null device": ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET deviceId = NULL WHERE correlationId = 100", "deviceId None"),
    "null stream": ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = NULL WHERE correlationId = 100", "streamId None"),
    "end before start": (
        "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 5 WHERE correlationId = 100",
        "ends before",
    ),
    "end near 2^63": (
        f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = {2**63 - 2} WHERE correlationId = 100",
        "past 2^62",
    ),
    "negative": ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -50 WHERE correlationId = 100", "negative time"),
}


@pytest.mark.parametrize("case", sorted(ROWS))
def test_a_bad_kernel_row_is_one_line_naming_the_kernel(tmp_path, case):
    sql, needle = ROWS[case]
    path = _patch(write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100), K(AG, 10, 20, stream=9)]), sql)
    with pytest.raises(ProfileError) as err:
        nsys_sqlite.read(path)
    msg = str(err.value)
    assert needle in msg and "sm90_xmma_gemm" in msg and str(path) in msg and "\n" not in msg


def test_a_blob_name_is_read_as_text(tmp_path):
    path = write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100), K(AG, 10, 20, stream=9)])
    _patch(path, "UPDATE StringIds SET value = ? WHERE value = ?", AG.encode(), AG)
    _patch(path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = x'00ff' WHERE correlationId = 100")
    prof = nsys_sqlite.read(path)
    assert sorted(a.name for a in prof.kernels) == ["<string \x00\ufffd>", AG]


def test_a_fifo_a_link_loop_and_a_missing_file_each_say_so(tmp_path):
    os.mkfifo(fifo := tmp_path / "rank0.sqlite")
    with pytest.raises(ProfileError, match="not a regular file"):
        nsys_sqlite.profile_files(fifo)
    with pytest.raises(ProfileError, match=r"rank0.sqlite is not a regular file"):
        nsys_sqlite.profile_files(tmp_path)  # in a directory too: never opened, so never blocking
    (loop := tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ProfileError, match="symbolic link loop"):
        nsys_sqlite.profile_files(loop)
    with pytest.raises(ProfileError, match="no such file or directory"):
        nsys_sqlite.profile_files(tmp_path / "nowhere")


def test_two_files_of_one_rank_are_refused_naming_both(r8, tmp_path):
    dense_step(tmp_path, "rank0.sqlite")
    dense_step(tmp_path, "job_0.sqlite")
    with pytest.raises(ProfileError) as err:
        overlap_report.report_profiles([tmp_path], r8)
    assert "job_0.sqlite" in str(err.value) and "rank0.sqlite" in str(err.value) and "both rank 0" in str(err.value)


def test_no_communication_is_no_ok(r8, tmp_path):
    write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100)])
    rep = overlap_report.report_profiles([tmp_path], r8)
    assert [(f["code"], f["level"]) for f in rep["findings"]] == [("no_communication", "error")]


def test_a_claimed_overlap_absent_from_the_profile_is_a_finding(r8, tmp_path):
    """R8: CP2 (attention always overlaps it) and DP4 with overlap_grad_reduce on; only DP in the profile."""
    write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100), K(RS, 10, 20, stream=9)])
    rep = overlap_report.report_profiles([tmp_path], r8)
    f = next(f for f in rep["findings"] if f["code"] == "cp_overlap_unmeasured")
    assert f["level"] == "error" and "no CP kernel" in f["message"]
    assert "dp_overlap_unmeasured" not in {f["code"] for f in rep["findings"]}


def test_the_plan_gpu_against_the_profile_gpu(planned, tmp_path):
    from overlapkit.bridge.build import make_plan

    h200 = make_plan(R8, gpu="h200", caller_env={}).to_dict()
    write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100), K(RS, 10, 20, stream=9), K(SENDRECV, 30, 40, stream=8)])
    codes = [f for f in overlap_report.report_profiles([tmp_path], h200)["findings"] if f["code"] == "profile_gpu"]
    assert len(codes) == 1 and H100 in codes[0]["message"] and "GPU=h200" in codes[0]["message"]
    (tmp_path / "rank0.sqlite").unlink()
    write(
        tmp_path / "rank0.sqlite",
        [K(GEMM, 0, 100), K(RS, 10, 20, stream=9), K(SENDRECV, 30, 40, stream=8)],
        gpu="NVIDIA H200",
    )
    assert "profile_gpu" not in {f["code"] for f in overlap_report.report_profiles([tmp_path], h200)["findings"]}


def test_dp_not_in_plan_names_a_real_knob(planned, tmp_path):
    from overlapkit.bridge.build import make_plan

    one = make_plan(R8, sets="model.context_parallel_size=8", caller_env={}).to_dict()  # DP1
    write(tmp_path / "rank0.sqlite", [K(GEMM, 0, 100), K(RS, 10, 20, stream=9)])
    f = next(f for f in overlap_report.report_profiles([tmp_path], one)["findings"] if f["code"] == "class_not_in_plan")
    assert "NODES=" in f["fix"] and "ddp" not in f["fix"]


# Real names (issue 31): NCCL >= 2.27 symmetric kernels, AllGatherV, RCCL's Generic, DeepSeek's and AMD's DeepEP.
REAL = {
    "ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16(ncclSymkDevWorkArgs4K)": "AllReduce",
    "ncclSymkDevKernel_ReduceScatter_LL_sum_f32(ncclSymkDevWorkArgs4K)": "ReduceScatter",
    "ncclSymkDevKernel_AllGather_LLMC(ncclSymkDevWorkArgs4K)": "AllGather",
    "ncclDevKernel_AllGatherV_RING_SIMPLE(ncclDevKernelArgsStorage<4096ul>)": "AllGatherV",
    "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)": "Generic",
    "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)": "Generic",
    "void dpsk::ep::internode::dispatch<true, 8, 16>(int4*, float*, int*)": "deepep",
    "void dpsk::ep::internode::combine<__nv_bfloat16, 8>(int4*)": "deepep",
    "void dpsk::ep::internode::notify_dispatch<8>(int const*, int*)": "deepep",
    "void dpsk::ep::internode::cached_notify<8>(int, int)": "deepep",
    "void primus_turbo::deep_ep::intranode::dispatch<8, 768>(int4*)": "deepep",
    # NCCL EP (the ncclep backend, issue 42): NVIDIA/nccl contrib/nccl_ep/device/low_latency.cu and jit/
    "void nccl_ep::internode_ll::dispatch<false, false, 7168, (ncclEpLayout_t)0, true>(void const*, long const*)": (
        "deepep"
    ),
    "void nccl_ep::internode_ll::combine<false, 7168, (ncclEpLayout_t)0, true>(void const*, int const*)": "deepep",
    "void nccl_ep::internode_ll::cleanLowLatencyBufferKernel(int*, int, int*, int)": "deepep",
    "nccl_ep_jit_ht_dispatch_kernel": "deepep",
    "nccl_ep_jit_ht_combine_kernel": "deepep",
    "nccl_ep_jit_ht_scan_kernel": "deepep",
    "flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64>>": None,  # compute, not EP's combine
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_kernel_families(name):
    assert overlap_classes.name_kind(name) == REAL[name]


def test_an_unknown_comm_like_kernel_is_a_warning_naming_it(r8, tmp_path):
    odd = "void mscclpp::allreduce_packet_kernel<bf16>(void*)"
    acts = [K(GEMM, 0, 100), K(RS, 10, 20, stream=9), K(odd, 200, 260, stream=8), K(odd, 300, 330, stream=8)]
    write(tmp_path / "rank0.sqlite", acts)
    rep = overlap_report.report_profiles([tmp_path], r8)
    assert rep["unknown_comm"] == [{"name": odd, "kernels": 2, "ms": 0.09}]  # each of its kernels counted
    f = next(f for f in rep["findings"] if f["code"] == "unknown_comm_kernel")
    assert odd in f["message"] and "(2 kernels, 0.09 ms)" in f["message"] and f["level"] == "warning"


def test_megatron_process_groups_decide_the_class():
    assert overlap_classes.group_class("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert overlap_classes.group_class("DATA_PARALLEL_GROUP_WITH_CP") == "dp"
    assert overlap_classes.group_class("INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP") == "dp"
    assert overlap_classes.group_class("EXPERT_MODEL_PARALLEL_GROUP") == "ep"
    assert overlap_classes.group_class("EXPERT_DATA_PARALLEL_GROUP") == "dp"
    assert overlap_classes.group_class("HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L0") == "cp"
    assert overlap_classes.group_class("PIPELINE_MODEL_PARALLEL_GROUP") == "pp"
    assert overlap_classes.group_class("TENSOR_AND_DATA_PARALLEL_GROUP") is None
    assert overlap_classes.group_class("default_pg") is None


def _trace(path, kernels, rank=0):
    """A minimal Kineto trace: kernels [(name, ts us text, dur, stream, group)] launched in ProfilerStep#1."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 10_000, "tid": 1}]
    for i, (name, ts, dur, stream, group) in enumerate(kernels):
        args = {"device": 0, "stream": stream, "correlation": i + 1}
        if group:
            args["Process Group Description"] = group
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream, "args": args})
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": 1,
                "dur": 1,
                "tid": 1,
                "args": {"correlation": i + 1},
            }
        )
    path.write_text(
        json.dumps({"distributedInfo": {"rank": rank}, "traceEvents": ev}).replace('"@', "").replace('@"', "")
    )
    return path


def test_a_trace_group_decides_and_decimals_are_exact(r8, tmp_path):
    """A reduce-scatter in Megatron's DATA_PARALLEL_GROUP is DP's by its group, before any name or plan rule. Times
    with three decimals are exact ns; a fourth is rounded to the nearest ns."""
    _trace(
        tmp_path / "rank-0.json",
        [
            (GEMM, "@100.001@", "@50.501@", 7, ""),
            (RS, "@120.000@", "@60.0006@", 9, "DATA_PARALLEL_GROUP"),
        ],
    )
    from overlapkit.profile import torch_trace

    prof = torch_trace.read(tmp_path / "rank-0.json")
    assert [(a.start, a.end) for a in prof.kernels] == [(100_001, 150_502), (120_000, 180_001)]
    rep = overlap_report.report_profiles([tmp_path], r8)
    assert rep["classes"]["dp"]["kernels"] == 1 and rep["rules"][0]["rule"].startswith("group:")
    assert rep["classes"]["dp"]["exposed_ms"] == 0.029  # 180001 - 150502 ns


def test_the_timeline_is_bounded_whatever_the_kernel_count(r8, tmp_path):
    """50k kernels on 300 streams: at most MAX_LANES + 1 lanes, each class at most PIXELS + 1 bars."""
    acts = [K(GEMM if i % 3 else RS, i * 2, i * 2 + 1.5, stream=i % 300) for i in range(50_000)]
    write(tmp_path / "rank0.sqlite", acts)
    m = overlap_report.measure(nsys_sqlite.profile_files(tmp_path), r8)
    t = m.timeline
    assert len(t.lanes) == overlap_report.MAX_LANES + 1
    assert max(len(b) for _, d in t.lanes for b in d.values()) <= overlap_report.PIXELS + 1
    png = overlap_report.timeline_png(m, tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_run_writes_replace_planted_links_and_refuse_plan_options(planned, tmp_path, make_here):
    run = tmp_path / "run"
    (run / "nsys").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps(planned(R70).to_dict(), default=str))
    dense_step(run / "nsys")
    (victim := tmp_path / "victim").write_text("keep")
    (run / "overlap_report.json.tmp").symlink_to(victim)
    (run / "overlap_timeline.png").symlink_to(victim)
    (run / "overlap_report.json").symlink_to(victim)
    code, _, err = make_here("overlap-report", f"RUN={run}")
    assert code == 1 and victim.read_text() == "keep", err
    assert not (run / "overlap_timeline.png").is_symlink() and not (run / "overlap_report.json").is_symlink()
    assert json.loads((run / "overlap_report.json").read_text())["timeline"] == str(run / "overlap_timeline.png")
    for extra in ("SET=train.train_iters=5", "NODES=2", "GPU=a100"):
        code, out, err = make_here("overlap-report", f"RUN={run}", extra)
        assert code == 2 and err.count("\n") == 1 and extra.split("=")[0] + "=" in err and "plan.json" in err
    for png in ("x.txt", "x.xyz", str(tmp_path / "noext")):
        code, out, err = make_here("overlap-report", f"RUN={run}", f"PNG={png}")
        assert code == 2 and err.count("\n") == 1 and "ending in .png" in err
    assert not (tmp_path / "noext.png").exists()
