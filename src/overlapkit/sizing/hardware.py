"""The GPUs a plan can target, in the numbers the throughput model reads: datasheet peaks and bandwidths, each cited.

Nothing here is fitted (the fitted constants are sizing/calibration.py's). `GPU=h200` selects the H200 row; every other
part of the node (8 GPUs on one NVSwitch, one 400 Gb/s NIC per GPU) is the same DGX/HGX design.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownGpu(ValueError):
    """One-line, user-facing."""


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict  # dense (no sparsity) Tensor Core peak per dtype
    nvlink_gbs: float  # GB/s per GPU, each direction
    network_gbs: float  # GB/s per GPU, each direction (one NIC per GPU)
    hbm_tbs: float  # TB/s
    hbm_gb: float  # GB (10**9 B) as the datasheet states it


# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/, H100 SXM column): BF16 1,979 and FP8
# 3,958 TFLOPS, both "with sparsity", so 989.4 and 1,978.9 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s per GPU
# (both directions together: 450 GB/s each way). DGX H100 user guide (docs.nvidia.com/dgx/dgxh100-user-guide,
# "Hardware Overview"): 8 × ConnectX-7 400 Gb/s InfiniBand NDR for the compute fabric, one per GPU = 50 GB/s each way.
H100 = Hardware("H100 SXM", {"bf16": 989.4, "fp8": 1978.9}, 450.0, 50.0, 3.35, 80.0)
# NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/, H200 SXM column): the same BF16 1,979 and
# FP8 3,958 TFLOPS with sparsity and NVLink 900 GB/s as H100 SXM (the same GH100 die), 141 GB HBM3e at 4.8 TB/s.
# NVIDIA's own MLPerf system description agrees (mlcommons/inference_results_v4.1, closed/NVIDIA/systems/
# H200-SXM-141GBx8_TRT_MaxQ.json: "141 GB" HBM3e, "18x 4th Gen NVLink, 900GB/s"). DGX H200 keeps DGX H100's eight
# ConnectX-7 400 Gb/s NICs (DGX H200 user guide, "Hardware Overview").
H200 = Hardware("H200 SXM", {"bf16": 989.4, "fp8": 1978.9}, 450.0, 50.0, 4.8, 141.0)
HARDWARE = {"h100": H100, "h200": H200}


def hardware(gpu: str) -> Hardware:
    """The Hardware row of `gpu` (case-insensitive); UnknownGpu (one line, naming the choices) otherwise."""
    try:
        return HARDWARE[gpu.lower()]
    except KeyError:
        raise UnknownGpu(f"GPU={gpu}: unknown GPU, use one of {', '.join(HARDWARE)}") from None
