"""Comparison rules on synthetic runs (logs printed by Bridge's training_log, nightly_fixtures.py), bless, the nightly
shape, the report with its plots, and the crash-safe history. No golden here is a real number: all are synthetic."""

from __future__ import annotations

import json
import os

import pytest
from nightly_fixtures import bridge_log, curve

from overlapkit.regress import logparse, night_report, nightly
from overlapkit.regress import rules as regress

N = 60
PLAN = {"recipe": "llama3_70b_pretrain_64gpu_h100_bf16", "layout": {"tp": 4, "pp": 4, "cp": 2, "nodes": 8},
        "overrides": [], "audit": {"rows": {"tp_comm_overlap": {"state": "on"}, "overlap_p2p_comm": {"state": "on"},
                                            "overlap_param_gather_with_optimizer_step": {"state": "off"}}}}  # fmt: skip


def run(step=2000.0, tflops=400.0, loss_scale_from=None, loss_factor=1.0, nan_at=None, extra="") -> dict:
    losses = curve(N)
    if loss_scale_from is not None:
        losses = [v * (loss_factor if i + 1 >= loss_scale_from else 1) for i, v in enumerate(losses)]
    if nan_at:
        losses[nan_at - 1] = float("nan")
    text = bridge_log(losses, [4000.0] * 3 + [step] * (N - 3), tflops=[100.0] * 3 + [tflops] * (N - 3))
    return logparse.parse_text(text + extra)


@pytest.fixture(scope="module")
def golden():
    return regress.make_golden(run(), PLAN, {"versions": {"megatron-bridge": "0.6.2"}})


def test_same_run_passes_and_small_noise_passes(golden):
    assert regress.classify(run(), "COMPLETED", golden).status == "pass"
    assert regress.classify(run(step=2060.0, tflops=389.0), "COMPLETED", golden).status == "pass"  # +3 %, -2.75 %


def test_slower_run_is_a_regression(golden):
    v = regress.classify(run(step=2300.0, tflops=348.0), "COMPLETED", golden)
    assert v.status == "regression" and not v.ok
    assert any(r.startswith("step_time_ms: 2300 vs golden 2000 (+15.0%") for r in v.reasons)


def test_faster_beyond_tolerance_is_an_unexpected_improvement(golden):
    v = regress.classify(run(step=1700.0, tflops=470.0), "COMPLETED", golden)
    assert v.status == "unexpected_improvement" and not v.ok and "a knob likely changed" in v.reasons[-1]


def test_loss_tolerance_is_tiered_looser_early(golden):
    assert regress.loss_tolerance(1) > regress.loss_tolerance(20) > regress.loss_tolerance(50)
    early = run(loss_scale_from=1, loss_factor=1.02)  # +2 % everywhere: inside tier 1, outside later tiers
    assert regress.classify(early, "COMPLETED", golden).status == "regression"
    only_early = regress.compare(run(loss_scale_from=1, loss_factor=1.0), golden)
    assert [c["verdict"] for c in only_early if c["metric"] == "lm_loss"] == ["ok"]
    late = regress.classify(run(loss_scale_from=40, loss_factor=0.99), "COMPLETED", golden)  # -1 % late: drift
    assert late.status == "regression" and "lm_loss at iteration" in late.reasons[0]
    g = dict(golden, loss={"2": golden["loss"]["2"]})  # only iteration 2 golden: +2 % is within ±3 %
    assert regress.classify(run(loss_scale_from=1, loss_factor=1.02), "COMPLETED", g).status == "pass"


def test_hard_failures_are_never_retried(golden):
    ima = "CUDA error: an illegal memory access was encountered\n"
    watchdog = "[E] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE)\n"
    for parsed in (run(nan_at=30), run(extra=ima), run(extra=watchdog)):
        v = regress.classify(parsed, "FAILED", golden)
        assert v.status == "hard_failure" and not v.retry
    # a NaN run with a node failure banner too: the NaN decides, no retry
    v = regress.classify(run(nan_at=5, extra="DUE TO NODE FAILURE\n"), "NODE_FAIL", golden)
    assert v.status == "hard_failure" and not v.retry


def test_infrastructure_failures_get_exactly_one_retry(golden):
    for state, extra in (("NODE_FAIL", ""), ("PREEMPTED", ""), ("CANCELLED", "*** JOB 7 CANCELLED DUE TO PREEMPTION")):
        first = regress.classify(run(extra=extra), state, golden, attempt=0)
        assert first.status == "infra_retry" and first.retry
        again = regress.classify(run(extra=extra), state, golden, attempt=1)
        assert again.status == "infra_failure" and not again.retry
    assert not regress.classify(run(), "TIMEOUT", golden).retry


def test_no_golden_preflight_only_and_never_started():
    assert regress.classify(run(), "COMPLETED", None).reasons == ["no golden yet: bless a reviewed run"]
    v = regress.classify(None, "COMPLETED", None, preflight_only=True, preflight_ok=True)
    assert v.status == "preflight_only" and v.reasons == ["preflight only — no training on this machine"]
    assert regress.classify(None, "FAILED", None, preflight_only=True).status == "preflight_failed"
    assert regress.classify(logparse.parse_text("building model\n"), "FAILED", None).status == "hard_failure"


def _run_dir(tmp_path, name, parsed_text, meta=None):
    d = tmp_path / name
    d.mkdir()
    (d / "plan.json").write_text(json.dumps(PLAN))
    (d / "train.log").write_text(parsed_text)
    (d / "nightly.json").write_text(json.dumps(meta or {"preflight_only": False}))
    return d


def test_bless_refuses_bad_runs_and_writes_a_good_one(tmp_path):
    good = bridge_log(curve(N), [2000.0] * N)
    d = _run_dir(tmp_path, "good", good)
    out = regress.bless(d, logparse.parse_file(d / "train.log"), tmp_path / "goldens")
    g = json.loads(out.read_text())
    assert out.name == f"{PLAN['recipe']}.json" and len(g["loss"]) == N and g["step_time_ms"] == 2000.0
    nan = curve(N)
    nan[10] = float("nan")
    with pytest.raises(regress.BlessError, match="hard failure: NaN"):
        regress.bless(d, logparse.parse_text(bridge_log(nan, [2000.0] * N)), tmp_path / "goldens")
    with pytest.raises(regress.BlessError, match="no training iterations"):
        regress.bless(d, logparse.parse_text("> building\n"), tmp_path / "goldens")
    pre = _run_dir(tmp_path, "pre", "", {"preflight_only": True})
    with pytest.raises(regress.BlessError, match="preflight-only"):
        regress.bless(pre, logparse.parse_text(""), tmp_path / "goldens")


def test_nightly_shape_keeps_model_parallelism_and_microbatches():
    s70 = nightly.shape_for("r", {"tp": 4, "pp": 4, "cp": 2, "mbs": 1, "gbs": 256, "nodes": 8})
    assert (s70.nodes, s70.dp, s70.gbs) == (8, 2, 256)
    s175 = nightly.shape_for("r", {"tp": 4, "pp": 8, "cp": 1, "mbs": 1, "gbs": 256, "nodes": 16})
    assert (s175.nodes, s175.dp, s175.gbs) == (8, 2, 128)  # 64 micro-batches per DP rank, as in the full recipe
    s405 = nightly.shape_for("r", {"tp": 8, "pp": 8, "cp": 2, "mbs": 1, "gbs": 768, "nodes": 64}, min_dp=1)
    assert (s405.nodes, s405.dp, s405.gbs) == (16, 1, 192)
    s8 = nightly.shape_for("r", {"tp": 1, "pp": 1, "cp": 2, "mbs": 1, "gbs": 128, "nodes": 1})
    assert (s8.nodes, s8.dp, s8.gbs) == (1, 4, 128)  # a whole node is the smallest allocation
    assert "rng.seed=1234" in s8.sets and "checkpoint.save=null" in s8.sets and "train.train_iters=60" in s8.sets


def test_nightly_overrides_plan_cleanly_with_bridge():
    from overlapkit.plan.build import make_plan

    shape = nightly.shape_for("llama3_8b_pretrain_8gpu_h100_fp8cs",
                              {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "gbs": 128, "nodes": 1})  # fmt: skip
    plan = make_plan(shape.recipe, nodes=shape.nodes, sets=shape.sets)
    assert plan.report.ok and plan.cfg.train.train_iters == 60 and plan.cfg.checkpoint.save is None
    assert plan.cfg.dataset.blend is None and plan.cfg.logger.log_interval == 1


def test_report_end_to_end_with_plots(tmp_path, golden):
    from PIL import Image

    gdir = tmp_path / "goldens"
    gdir.mkdir()
    (gdir / f"{PLAN['recipe']}.json").write_text(json.dumps(golden))
    hist = tmp_path / "history.jsonl"
    for k, step in enumerate((2000.0, 2010.0, 2400.0)):
        text = bridge_log(curve(N), [4000.0] * 3 + [step] * (N - 3))
        d = _run_dir(tmp_path, f"run{k}", text)
        entry = {"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": str(k)}
        res = night_report.evaluate(entry, "COMPLETED", [d / "train.log"], gdir, preflight_only=False)
        night = {"stamp": f"2026010{k + 1}-000000", "cluster": "test", "preflight_only": False}
        skipped = {"recipe": "llama31_405b_pretrain_512gpu_h100_bf16", "skipped": "needs 32 nodes"}
        report = night_report.write_report(tmp_path / f"night{k}", night, [res, skipped], hist).read_text()
    assert "**regression**" in report and "step_time_ms: 2400 vs golden 2000" in report
    assert "tp_comm_overlap, overlap_p2p_comm" in report and "| skipped |" in report
    pngs = sorted((tmp_path / "night2" / "plots").glob("*.png"))
    assert [p.name for p in pngs] == [f"loss_{PLAN['recipe']}.png", "step_time_history.png"]
    for p in pngs:
        assert p.stat().st_size > 10_000
        px = list(Image.open(p).convert("L").getdata())
        mean = sum(px) / len(px)
        assert sum((x - mean) ** 2 for x in px) / len(px) > 100  # not a blank canvas
    assert [r["step_time_ms"] for r in night_report.read_history(hist)] == [2000.0, 2010.0, 2400.0]


def test_history_survives_a_crash_mid_write(tmp_path, monkeypatch):
    hist = tmp_path / "history.jsonl"
    night_report.append_history(hist, [{"night": "n1", "recipe": "a", "step_time_ms": 1.0}])
    real_write = os.write

    def torn_write(fd, data):  # the machine dies after half the bytes reached the file
        real_write(fd, data[: len(data) // 2])
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "write", torn_write)
    with pytest.raises(OSError):
        night_report.append_history(hist, [{"night": "n2", "recipe": "a", "step_time_ms": 2.0}])
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("fsync failed")))
    with pytest.raises(OSError):
        night_report.append_history(hist, [{"night": "n3", "recipe": "a", "step_time_ms": 3.0}])
    monkeypatch.undo()
    assert [r["night"] for r in night_report.read_history(hist)] == ["n1", "n3"]  # n1 intact; n2 torn, skipped
    night_report.append_history(hist, [{"night": "n4", "recipe": "a", "step_time_ms": 4.0}])
    assert [r["night"] for r in night_report.read_history(hist)] == ["n1", "n3", "n4"]
