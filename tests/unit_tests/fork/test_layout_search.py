"""The layout search: every split of a model over N H100s that divides, fits memory and keeps the overlap stack on,
ranked; and its one-line refusals."""

from __future__ import annotations

import pytest

from overlapkit.fork.layout_search import LayoutSearchError, layout_errors, search
from overlapkit.plan import presets
from overlapkit.shape import ModelShape

# CodeLlama-34B's published shape (see test_scaffold.py): Llama3 70B's hidden and GQA with 48 layers, FFN 22016.
SHAPE_34B = ModelShape(hidden=8192, layers=48, heads=64, query_groups=8, ffn=22016, seq=8192, vocab=128256)


# --- layout search -------------------------------------------------------------------------------------------------


def test_34b_on_32_gpus_returns_layouts_that_divide_and_fit():
    cands = search(SHAPE_34B, 32, gbs=256)
    assert len(cands) == 5
    for c in cands:
        assert layout_errors(SHAPE_34B, 32, c.tp, c.pp, c.vpp, c.cp, c.mbs, c.gbs) == []
        assert c.tp * c.pp * c.cp * c.dp == 32 and c.memory.fits
        assert c.pp == 1 or c.vpp > 1  # p2p overlap on whenever there is a pipeline
        assert "\n" not in c.why and c.why
    top = cands[0]
    # Ranked by predicted TFLOP/s. Every split here runs the same per-layer work on a GPU (layers/PP × microbatches
    # passes, each over the GPU's s·b/(CP·TP) tokens), so what tells them apart is the exposed communication: TP4's
    # userbuffers leave 1/4 of its collectives exposed (0.69 s a step), while TP1 PP8 CP4 has no TP collectives and
    # its CP ring hides under core attention. With the precision-aware rates (BF16 GEMMs at gemm_bf16 of the BF16
    # peak) that puts TP4 PP2 CP1 VP12 (what the rules picked when it was within 2%) 2.1% under the best: outside
    # the tie, so the search now leads with TP1 PP8 CP4 (DP1: its grad reduce over DP×CP=4 inside a node is 0.03 s
    # unhidden). Within 2% of the best (a tie) the rules decide: an exact preset or TP1 first, so TP2 PP4 CP2 ranks
    # after the TP1 splits; among those the largest VPP that keeps ≥ 2 layers per chunk (VP3 of PP8's 6 layers).
    assert top.describe() == "TP1 PP8 CP4 VP3 DP1 MBS1 GBS256"
    assert top.preset is None and top.exact_preset  # TP1: TP overlap n/a, no userbuffers preset needed
    assert f"predicted {top.tflops:.0f} TFLOP/s/GPU" in top.why
    best = max(c.tflops for c in cands)
    assert top.tflops >= 0.98 * best and top.loses == "" and all(c.loses for c in cands[1:])
    assert cands[1].loses == "within 2% of the best prediction (a tie); smaller VPP"
    assert [c.tp for c in cands[3:]] == [2, 2] and all("no exact userbuffers preset" in c.loses for c in cands[3:])
    tp4 = search(SHAPE_34B, 32, gbs=256, fixed={"tp": 4, "pp": 2, "cp": 1})[0]
    assert tp4.describe() == "TP4 PP2 CP1 VP12 DP4 MBS1 GBS256" and 0.97 * best < tp4.tflops < 0.98 * best
    assert tp4.prediction.share("TP all-gather/reduce-scatter") > 0.02
    old = search(SHAPE_34B, 32, gbs=256, fixed={"tp": 4, "pp": 1, "cp": 2})[0]
    assert old.describe() == "TP4 PP1 CP2 VP- DP4 MBS1 GBS256" and old.tflops < 0.98 * best
    # TP4 PP1 CP2 runs 48 layers × 64 microbatches per GPU, twice the passes of the PP8 or PP2 splits
    assert old.prediction.share("per-layer non-GEMM") > top.prediction.share("per-layer non-GEMM")


def test_a_slower_layout_says_how_much_and_where():
    cands = search(SHAPE_34B, 32, gbs=256, fixed={"tp": 4}, top=80)
    slower = [c for c in cands if "slower predicted" in c.loses]
    assert slower, [c.loses for c in cands]
    c = slower[0]
    assert c.loses.startswith(f"{1 - c.tflops / cands[0].tflops:.1%} slower predicted (+")
    assert [c.tflops for c in slower] == sorted((c.tflops for c in slower), reverse=True)  # by prediction


def test_a_shape_without_preset_is_declared_default_explicitly():
    shape = ModelShape(hidden=5120, layers=40, heads=40, query_groups=8, ffn=17920, seq=8192, vocab=128256)
    with pytest.raises(presets.PresetError):  # really no preset for h5120
        presets.select(presets.PresetKey("h100", "bf16", 5120, 2, 1, 1, 8192))
    pinned = search(shape, 16, gbs=128, fixed={"tp": 2})
    assert all(c.preset == presets.DEFAULT_TP_CONFIG and not c.exact_preset for c in pinned)
    assert "explicit overlap.tp_preset=default" in pinned[0].why
    assert search(shape, 16, gbs=128)[0].tp == 1  # left free, the search prefers TP1 (TP overlap n/a) to no preset


@pytest.mark.parametrize(
    ("change", "gpus", "fixed", "needle"),
    [
        ({"heads": 60}, 32, None, "hidden 8192 is not divisible by heads 60"),
        ({"query_groups": 6}, 32, None, "heads 64 are not divisible by query groups 6"),
        ({}, 12, None, "use a multiple of 8"),
        ({"layers": 80, "ffn": 28672}, 8, None, "use more GPUs"),
        ({"layers": 47}, 32, {"pp": 2}, "layers 47 (+embedding/loss: 47) are not divisible by PP·VPP"),
        ({"seq": 8190}, 32, {"tp": 4, "cp": 2}, "not divisible by TP4"),
        ({}, 32, {"tp": 3}, "TP3 is not one of"),
    ],
)
def test_search_rejects_with_one_line_reasons(change, gpus, fixed, needle):
    shape = ModelShape(**{**SHAPE_34B.__dict__, **change})
    with pytest.raises(LayoutSearchError) as exc:
        search(shape, gpus, gbs=256, fixed=fixed)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
