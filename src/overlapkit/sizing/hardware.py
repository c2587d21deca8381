"""The GPUs a plan can be made for (GPU=h100, GPU=h200): each one's public specs, in one table that the memory
estimate (sizing/memory.py: how much HBM there is) and the throughput model (sizing/throughput.py: peaks, links, HBM
bandwidth) both read. Nothing here is fitted (the fitted constants are sizing/calibration.py's). Standard library
only: the request's check (spec/request.py) runs before the Bridge import.

Every part of the node but the GPU (8 GPUs on one NVSwitch, one 400 Gb/s NIC per GPU) is the same DGX/HGX design.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.errors import BadInput
from overlapkit.spec.topology import DEFAULT_GPU


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict  # dense (no sparsity) Tensor Core peak per dtype
    nvlink_gbs: float  # GB/s per GPU, each direction
    network_gbs: float  # GB/s per GPU, each direction (one NIC per GPU)
    hbm_tbs: float  # TB/s
    hbm_gb: float  # GiB, as nvidia-smi reports the card's total (MiB / 1024): what the memory budget starts from
    presets: str  # the GPU whose Bridge userbuffers presets (bridge/presets.py) this one runs


# NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100/, H100 SXM): BF16 1,979 and FP8 3,958 TFLOPS "with
# sparsity" (989.4 and 1,978.9 dense); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s both directions (450 each way). DGX
# H100 user guide ("Hardware Overview"): one ConnectX-7 400 Gb/s NDR NIC per GPU = 50 GB/s each way. H200 datasheet
# (nvidia.com/en-us/data-center/h200/, H200 SXM): the same GH100 die, peaks and NVLink; 141 GB HBM3e at 4.8 TB/s
# (NVIDIA's MLPerf v4.1 H200-SXM-141GBx8 system description agrees); DGX H200 keeps the eight NICs. nvidia-smi
# reports 81559 MiB (H100 SXM5 80 GB) and 143771 MiB (H200 SXM 141 GB). Bridge's userbuffers presets are H100's only
# (training/comm_overlap.py, 0.6.2), tuned for the GH100's 132 SMs, which the H200 has too.
_PEAKS = {"bf16": 989.4, "fp8": 1978.9}
HARDWARE = {
    "h100": Hardware("H100 SXM", _PEAKS, 450.0, 50.0, 3.35, 81559 / 1024, "h100"),
    "h200": Hardware("H200 SXM", _PEAKS, 450.0, 50.0, 4.8, 143771 / 1024, "h100"),
}


class GpuError(BadInput):
    """One-line, user-facing."""


def parse_gpu(text: str | None) -> str:
    """GPU= as typed (empty: the default) → a HARDWARE key, else a one-line GpuError naming the choices."""
    name = (text or "").strip().lower() or DEFAULT_GPU
    if name not in HARDWARE:
        raise GpuError(f"GPU={text}: not a GPU the models know; use one of {', '.join(HARDWARE)} (e.g. GPU=h200)")
    return name


def hardware(gpu: str | None) -> Hardware:
    return HARDWARE[parse_gpu(gpu)]


def retarget_note(recipe: str, gpu: str) -> str | None:
    """One line when the plan's GPU is not the one the recipe's name says (allowed: the same 8-GPU node shape)."""
    named = next((p for p in recipe.lower().split("_") if p in HARDWARE), None)  # the GPU the name says: `_h100_`
    if named is None or named == gpu:
        return None
    return (
        f"GPU={gpu}: an {named} recipe planned for {HARDWARE[gpu].name} (the same 8-GPU node): {gpu}'s memory and "
        f"bandwidth, Bridge's {HARDWARE[gpu].presets} userbuffers presets"
    )
