"""The GPU table: GPU= parsed to one of its entries (a bad value is one line naming the choices), the datasheet
numbers as cited (H200 = H100 compute and links with faster, larger HBM), one home for each GPU's HBM size (the
memory budget reads it), the presets an H200 runs, and the one line a plan prints when its GPU is not the one the
recipe's name says."""

from __future__ import annotations

import pytest

from overlapkit.bridge import presets
from overlapkit.sizing import hardware, memory
from overlapkit.sizing.hardware import HARDWARE
from overlapkit.spec.shape import ModelShape


def test_gpu_is_parsed_to_a_table_entry_or_one_line_naming_the_choices():
    assert hardware.parse_gpu("") == hardware.parse_gpu(None) == "h100"
    assert hardware.parse_gpu("H200") == hardware.parse_gpu(" h200 ") == "h200"
    with pytest.raises(hardware.GpuError) as exc:
        hardware.parse_gpu("b200")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("GPU=b200:") and "h100, h200" in msg


def test_h100_and_h200_are_the_datasheets_numbers():
    h100, h200 = hardware.hardware("h100"), hardware.hardware("H200")
    assert hardware.hardware("") == h100  # GPU= empty: the recipes' own GPU
    assert h100.peak_tflops == {"bf16": 989.4, "fp8": 1978.9}  # 1,979 / 3,958 TFLOPS with sparsity, halved
    assert (h100.nvlink_gbs, h100.network_gbs, h100.hbm_tbs) == (450.0, 50.0, 3.35)
    assert (h200.network_gbs, h200.hbm_tbs) == (50.0, 4.8)
    with pytest.raises(hardware.GpuError):
        hardware.hardware("b200")


def test_h200_is_an_h100_with_more_and_faster_hbm():
    h100, h200 = HARDWARE["h100"], HARDWARE["h200"]
    assert h200.peak_tflops == h100.peak_tflops and h200.nvlink_gbs == h100.nvlink_gbs  # the same GH100 die
    assert (h100.hbm_tbs, h200.hbm_tbs) == (3.35, 4.8)
    assert h100.hbm_gb == 81559 / 1024 and h200.hbm_gb == 143771 / 1024  # nvidia-smi MiB / 1024
    assert 140 < h200.hbm_gb < 141 and 79 < h100.hbm_gb < 80  # the datasheets' 141 GB and 80 GB, as GiB


def test_the_memory_budget_reads_the_table():
    toy = memory.Workload(ModelShape(hidden=1024, layers=8, heads=8, query_groups=8, ffn=4096, seq=2048, vocab=32000))
    for gpu, hw in HARDWARE.items():
        assert memory.estimate_workload(toy, gpu).budget_gb == pytest.approx(hw.hbm_gb - memory.MARGIN_GB)
    assert not hasattr(memory, "HBM_GB")  # no second home


def test_an_h200_runs_the_h100_userbuffers_presets():
    s = ModelShape(hidden=8192, layers=80, heads=64, query_groups=8, ffn=28672, seq=8192, vocab=128256)
    assert presets.PresetKey.of(s, tp=4, cp=2, mbs=1, gpu="h200") == presets.PresetKey.of(s, tp=4, cp=2, mbs=1)
    assert presets.PresetKey.of(s, tp=4, cp=2, mbs=1, gpu="h200").gpu == "h100"


def test_a_plan_for_another_gpu_than_the_recipes_says_so_in_one_line():
    name = "llama3_8b_pretrain_8gpu_h100_bf16"
    assert hardware.retarget_note(name, "h100") is None
    assert hardware.retarget_note("my_model_without_a_gpu", "h200") is None
    note = hardware.retarget_note(name, "h200")
    assert note.startswith("GPU=h200: an h100 recipe planned for H200 SXM") and "\n" not in note


def test_make_recipes_gpu_h200_lists_h200_predictions(make_here, monkeypatch):
    """`make recipes GPU=h200` (the Makefile's command line, its main): each row is the recipe's plan for H200 (the
    listing narrowed to one recipe: planning all eighteen again would add a minute to the suite)."""
    from overlapkit.bridge import registry
    from overlapkit.bridge.build import make_plan

    name = "llama3_8b_pretrain_8gpu_h100_fp8cs"
    monkeypatch.setattr(registry, "names", lambda: [name])
    code, out, err = make_here("recipes", "GPU=h200")
    assert code == 0, err
    assert "predicted model TFLOP/s per GPU on H200 SXM" in out and "memory and audit for GPU=h200" in out
    row = next(line for line in out.splitlines() if line.strip().startswith(name))
    assert f" {make_plan(name, gpu='h200').throughput.tflops_per_gpu:.0f} " in row
