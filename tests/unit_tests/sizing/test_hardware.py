"""The GPU table: datasheet numbers as cited, H200 = H100 compute and links with faster, larger HBM, and a one-line
error for a GPU it does not know."""

from __future__ import annotations

import pytest

from overlapkit.sizing import hardware


def test_h100_and_h200_are_the_datasheets_numbers():
    h100, h200 = hardware.hardware("h100"), hardware.hardware("H200")
    assert h100.peak_tflops == {"bf16": 989.4, "fp8": 1978.9}  # 1,979 / 3,958 TFLOPS with sparsity, halved
    assert (h100.nvlink_gbs, h100.network_gbs, h100.hbm_tbs, h100.hbm_gb) == (450.0, 50.0, 3.35, 80.0)
    assert h200.peak_tflops == h100.peak_tflops and h200.nvlink_gbs == h100.nvlink_gbs
    assert (h200.network_gbs, h200.hbm_tbs, h200.hbm_gb) == (50.0, 4.8, 141.0)


def test_an_unknown_gpu_is_one_line_naming_the_choices():
    with pytest.raises(hardware.UnknownGpu) as e:
        hardware.hardware("b200")
    assert str(e.value) == "GPU=b200: unknown GPU, use one of h100, h200"
