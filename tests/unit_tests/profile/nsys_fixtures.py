"""Nsight Systems SQLite exports built in the tests, to the documented schema: the tables and columns of Nsight's
"SQLite Export Schema Reference" (docs.nvidia.com/nsight-systems/UserGuide/index.html#sqlite-schema-reference, the
same columns as the 2021.5 exporter page docs.nvidia.com/nsight-systems/2021.5/nsys-exporter/exported_data.html),
every field NOT NULL as Nsight declares them. Times are given in microseconds and written in nanoseconds.

Kernel names are real ones, as the sources name them (see overlapkit/profile/overlap_classes.py for the files)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

# Compute: a Hopper cuBLAS GEMM, cuDNN's fused attention (TE's backend), a TE elementwise kernel.
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
ATTN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"
RMSNORM = "void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<__nv_bfloat16, float, 8192>(void*)"
# NCCL >= 2.19 (src/device/generate.py).
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
BCAST = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
# Transformer Engine userbuffers (comm_gemm_overlap/userbuffers/userbuffers.cu).
UB_RS = "void userbuffers_fp16_sum_inplace_gpu_rr_rs<4>(int, int, int, int, int, int, void**, int, unsigned long)"
UB_SEND = "kuserbuffers_pushsend(int*, int*, int4*, int4*, int)"
# DeepEP (csrc/kernels/intranode.cu).
DEEPEP_DISPATCH = "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*)"
DEEPEP_COMBINE = "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(__nv_bfloat16*, float*, int*, int*)"
# Megatron / Bridge NVTX ranges (megatron/core/utils.py nvtx_decorator: <module>.<function>).
STEP = "megatron.bridge.training.train.train_step"
P2P = "megatron.core.pipeline_parallel.p2p_communication.send_forward_recv_forward"

PTOP = 10  # CUPTI_ACTIVITY_MEMCPY_KIND_PTOP
H100 = "NVIDIA H100 80GB HBM3"
TID = 4242  # the training thread's globalTid

SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
  contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
  demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER, launchType INTEGER,
  cacheConfig INTEGER, registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
  gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL,
  staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT NULL,
  localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER, graphNodeId INTEGER,
  sharedMemoryLimitConfig INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
  contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
  bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL, deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER,
  srcDeviceId INTEGER, srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, migrationCause INTEGER,
  graphNodeId INTEGER, virtualAddress INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
  globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL,
  callchainId INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
  category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER,
  domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
  int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
CREATE TABLE TARGET_INFO_GPU (vendorName TEXT NOT NULL, id INTEGER NOT NULL, name TEXT NOT NULL,
  busLocation TEXT NOT NULL, isDiscrete INTEGER NOT NULL, l2CacheSize INTEGER NOT NULL, totalMemory INTEGER NOT NULL,
  memoryBandwidth INTEGER NOT NULL, clockRate INTEGER NOT NULL, smCount INTEGER NOT NULL, pwGpuId INTEGER NOT NULL,
  uuid TEXT NOT NULL, luid INTEGER, chipName TEXT NOT NULL, cuDevice INTEGER NOT NULL, ctxId INTEGER NOT NULL);
"""


@dataclass
class K:
    """A kernel (or, with copy=True, a peer-to-peer memcpy) from start to end µs on a stream, launched by TID at
    `launch` µs (default: 2 µs before it starts)."""

    name: str
    start: float
    end: float
    stream: int = 7
    launch: float | None = None
    copy: bool = False
    device: int = 0


def ns(us: float) -> int:
    return round(us * 1000)


def write(path: Path, acts: list[K], ranges=(), gpu: str = H100) -> Path:
    """An export with `acts` and NVTX `ranges` [(text, start µs, end µs)] on the training thread."""
    con = sqlite3.connect(path)
    con.executescript(SCHEMA)
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings) + 1
            con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    launch_api = sid("cudaLaunchKernel_v7000")
    for corr, a in enumerate(acts, start=100):
        t = ns(a.launch if a.launch is not None else a.start - 2)
        con.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?,?)",
            (t, t + 800, 1, TID, corr, launch_api, 0, 0),
        )
        if a.copy:
            row = (
                ns(a.start),
                ns(a.end),
                a.device,
                1,
                a.stream,
                corr,
                77,
                8 << 20,
                PTOP,
                0,
                2,
                2,
                a.device,
                1,
                1,
                1,
                0,
                0,
                0,
            )
            con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES ({','.join('?' * 19)})", row)
            continue
        short = sid(a.name.split("(")[0].split("<")[0].split()[-1])
        row = (ns(a.start), ns(a.end), a.device, 1, a.stream, corr, 77, sid(a.name), short, short, 0, 0, 128)
        row += (132, 1, 1, 256, 1, 1, 0, 0, 0, 0, corr, 0, 0, 0)
        con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({','.join('?' * 27)})", row)
    for i, (text, start, end) in enumerate(ranges):
        row = (ns(start), ns(end), 59, i, 0, 0, text, TID, TID, None, 0, 0, 0, 0.0, 0, 0, 0.0, None, None)
        con.execute(f"INSERT INTO NVTX_EVENTS VALUES ({','.join('?' * 19)})", row)
    gpu_row = ("NVIDIA", 0, gpu, "0000:18:00.0", 1, 52428800, 85520809984, 3352320000000, 1980000, 132, 0, "uuid", 0)
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", gpu_row + ("GH100", 0, 1))
    con.commit()
    con.close()
    return path


def dense_step(tmp_path: Path, name: str = "rank0.sqlite") -> Path:
    """Two train_step ranges on one 70B rank: every class hidden, partly hidden or exposed, each decided by a rule.

    Step 0 [0, 1000) µs: GEMMs 0-400 and 500-900. TP: userbuffers RS 100-200 (hidden), a P2P copy-engine memcpy
    380-460 (20 hidden, 60 exposed), the TP broadcast 10-30 (hidden) and an all-gather on its stream 910-950
    (exposed). CP: a SendRecv 550-600 outside any p2p range (hidden). PP: a SendRecv in Megatron's p2p range
    900-980 (exposed). DP: a reduce-scatter on its own stream 850-950 (50 hidden, 50 exposed).
    Step 1 [1000, 1500): a GEMM 1000-1500 and DP's all-gather 1100-1200 on the DP stream (hidden)."""
    acts = [
        K(GEMM, 0, 400),
        K(GEMM, 500, 900),
        K(UB_RS, 100, 200, stream=30),
        K("memcpy", 380, 460, stream=31, copy=True),
        K(BCAST, 10, 30, stream=20),
        K(AG, 910, 950, stream=20),
        K(SENDRECV, 550, 600, stream=40),
        K(SENDRECV, 900, 980, stream=50, launch=880),
        K(RS, 850, 950, stream=60),
        K(GEMM, 1000, 1500, launch=999),
        K(AG, 1100, 1200, stream=60),
    ]
    ranges = [(STEP, -10, 990), (P2P, 870, 890), (STEP, 995, 1400)]
    return write(tmp_path / name, acts, ranges)
