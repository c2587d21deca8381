"""Comparison rules on synthetic runs (logs printed by Bridge's training_log, nightly_fixtures.py), bless, the nightly
shape, the report with its plots, and the crash-safe history. No golden here is a real number: all are synthetic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nightly_fixtures import bridge_log, curve

from launch import commands
from overlapkit.bridge import submission
from overlapkit.errors import BadInput
from overlapkit.nightly import logparse, night_report, nightly
from overlapkit.nightly import rules as regress

N = 60
PLAN = {"recipe": "llama3_70b_pretrain_64gpu_h100_bf16", "layout": {"tp": 4, "pp": 4, "cp": 2, "dp": 2, "nodes": 8,
                                                                    "gpus": 64, "mbs": 1, "gbs": 256, "seq": 8192},
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
    # A job that Slurm says COMPLETED (bless now needs the job: see the truth table below).
    job = {"state": "COMPLETED", "submission": {"job_id": "7"}}
    good = bridge_log(curve(N), [2000.0] * N)
    d = _run_dir(tmp_path, "good", good)
    out = regress.bless(d, logparse.parse_files([d / "train.log"]), tmp_path / "goldens", **job)
    g = json.loads(out.read_text())
    assert out.name == f"{PLAN['recipe']}.json" and len(g["loss"]) == N and g["step_time_ms"] == 2000.0
    nan = curve(N)
    nan[10] = float("nan")
    with pytest.raises(regress.BlessError, match="hard failure: NaN"):
        regress.bless(d, logparse.parse_text(bridge_log(nan, [2000.0] * N)), tmp_path / "goldens", **job)
    with pytest.raises(regress.BlessError, match="no training iterations"):
        regress.bless(d, logparse.parse_text("> building\n"), tmp_path / "goldens", **job)
    pre = _run_dir(tmp_path, "pre", "", {"preflight_only": True})
    with pytest.raises(regress.BlessError, match="preflight-only"):
        regress.bless(pre, logparse.parse_text(""), tmp_path / "goldens", **job)
    with pytest.raises(regress.BlessError, match="no submission.json"):  # no job, no Slurm verdict
        regress.bless(d, logparse.parse_files([d / "train.log"]), tmp_path / "goldens")


# --- bless: plan, log and Slurm state must agree (rules.bless_checks) -------------------------------------------
# A real preflight-only `make submit` run on the local Slurm (paths shortened to /jobs and /repo): plan.json (8 GPUs,
# GBS 128), nemo_run's task script (with --preflight-only), its sbatch output (the traced srun line names the
# experiment, so the recipe) and the task's log (our preflight line: 8/8 ranks). The training log is Bridge's own.
FIXTURE = Path(__file__).parent / "fixtures" / "preflight_submit_run"
REAL_PLAN = json.loads((FIXTURE / "plan.json").read_text())
JOB_LOGS = ("sbatch_root-root.train_8.out", "log-root-root.train_8_0.out")


def _train(gbs=128, n=20, nan_at=None, memory=True) -> str:
    losses = curve(n)
    if nan_at:
        losses[nan_at - 1] = float("nan")
    log = bridge_log(losses, [2000.0] * n, world=8, gbs=gbs)
    return log if memory else "".join(ln for ln in log.splitlines(True) if not ln.startswith("[Rank "))


def _job_text(world=8, recipe=None) -> str:
    text = "".join((FIXTURE / f).read_text() for f in JOB_LOGS).replace("(8/8 ranks)", f"({world}/{world} ranks)")
    return text.replace(REAL_PLAN["recipe"], recipe) if recipe else text


AGREEING = {"train": {}, "job": {}, "state": "COMPLETED", "meta": {"job_id": "8", "preflight_only": False}}
CASES = {  # one disagreement each -> the words its reason must hold
    "preflight-only run": ({"meta": {"job_id": "8", "preflight_only": True}}, "preflight-only run"),
    "no job": ({"meta": {"preflight_only": False}}, "no submission.json"),
    "job failed": ({"state": "FAILED"}, "Slurm job 8 is FAILED, not COMPLETED"),
    "job unknown to Slurm": ({"state": None}, "Slurm job 8 is UNKNOWN"),
    "no iterations": ({"train": None}, "no training iterations in the log"),
    "NaN loss": ({"train": {"nan_at": 12}}, "hard failure: NaN"),
    "other GBS": ({"train": {"gbs": 64}}, "the log's global batch size 64 != the plan's 128"),
    "two GBS": ({"extra": {"gbs": 64}}, "the log's global batch size 64, 128 != the plan's 128"),
    "other world size": ({"job": {"world": 64}}, "the log's world size 64 != the plan's 8"),
    "other recipe": ({"job": {"recipe": "llama3_70b_pretrain_64gpu_h100_bf16"}},
                     "the log's recipe llama3_70b_pretrain_64gpu_h100_bf16 != the plan's llama3_8b"),
    "nightly.json's recipe": ({"meta": {"job_id": "8", "recipe": "llama3_70b_pretrain_64gpu_h100_bf16"}},
                              "nightly.json's recipe"),
    "no peak memory": ({"train": {"memory": False}}, "no peak memory in the log"),
}  # fmt: skip


def _checks(case: dict) -> list[str]:
    c = {**AGREEING, **case}
    text = _job_text(**c["job"]) + (_train(**c["train"]) if c["train"] is not None else "")
    text += _train(**c["extra"]) if "extra" in c else ""
    return regress.bless_checks(REAL_PLAN, logparse.parse_text(text), c["state"], c["meta"])


def test_bless_checks_pass_a_run_where_plan_log_and_slurm_agree():
    assert _checks({}) == []


@pytest.mark.parametrize("name", CASES)
def test_bless_checks_name_each_single_disagreement(name):
    case, words = CASES[name]
    problems = _checks(case)
    assert len(problems) == 1 and words in problems[0], problems
    assert ": " in problems[0] and "bless" in problems[0].split(": ", 1)[1]  # what disagrees, then the fix


def _submitted_run(tmp_path, *, preflight: bool, train: str) -> Path:
    """The fixture as make submit left it (run dir + nemo_run experiment), plus `train` as the task's log."""
    exp = tmp_path / "jobs" / "experiments" / REAL_PLAN["recipe"] / f"{REAL_PLAN['recipe']}_1796141532421389775"
    (exp / "train" / "scripts").mkdir(parents=True)
    script = (FIXTURE / "train.sh").read_text()
    if not preflight:  # a training run's script is the same without --preflight-only
        script = script.replace(" --preflight-only", "")
    (exp / "train" / "scripts" / "train.sh").write_text(script)
    (exp / "train" / JOB_LOGS[0]).write_text((FIXTURE / JOB_LOGS[0]).read_text())
    (exp / "train" / JOB_LOGS[1]).write_text((FIXTURE / JOB_LOGS[1]).read_text() + train)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(json.dumps(REAL_PLAN))
    (run_dir / "submission.json").write_text(json.dumps({"job_id": "8", "experiment_dir": str(exp)}))
    return run_dir


def test_make_bless_refuses_the_preflight_run_with_a_hand_placed_log(tmp_path, monkeypatch):
    # The sweep's case: a preflight-only submit run, a log with GBS 64 and no memory report put next to plan.json.
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "COMPLETED")
    run_dir = _submitted_run(tmp_path, preflight=True, train="")
    (run_dir / "train.log").write_text(_train(gbs=64, memory=False))
    with pytest.raises(regress.BlessError) as err:
        nightly.bless_run(run_dir, tmp_path / "goldens")
    msg = str(err.value)
    assert "\n" not in msg and "preflight-only run" in msg and "global batch size 64 != the plan's 128" in msg
    assert "no peak memory" in msg and not (tmp_path / "goldens").exists()


def test_make_bless_blesses_a_completed_training_run_and_refuses_it_while_slurm_disagrees(tmp_path, monkeypatch):
    run_dir = _submitted_run(tmp_path, preflight=False, train=_train())
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "CANCELLED by 0")
    with pytest.raises(regress.BlessError, match="Slurm job 8 is CANCELLED by 0, not COMPLETED"):
        nightly.bless_run(run_dir, tmp_path / "goldens")
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "COMPLETED")
    out = nightly.bless_run(run_dir, tmp_path / "goldens")
    g = json.loads(out.read_text())
    assert out.name == f"{REAL_PLAN['recipe']}.json" and len(g["loss"]) == 20 and g["peak_mem_gb"] == 60.0


def _bless(run_dir, goldens, *flags) -> int:
    """`make bless RUN=<run_dir> [FORCE=1]` in process, into `goldens` (the repository's own goldens stay put)."""
    return commands.call("bless", ["--run", str(run_dir), "--goldens", str(goldens), *flags])


def test_bless_over_a_golden_needs_force_and_says_what_it_changes(tmp_path, monkeypatch, capsys):
    # B002 (hostile sweep 5): a run 7x slower replaced the golden with no FORCE and no word.
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "COMPLETED")
    good = _submitted_run(tmp_path / "a", preflight=False, train=_train())
    slow = _submitted_run(
        tmp_path / "b", preflight=False, train=bridge_log(curve(20), [14000.0] * 20, world=8, gbs=128)
    )
    goldens = tmp_path / "goldens"
    assert _bless(good, goldens) == 0
    golden = goldens / f"{REAL_PLAN['recipe']}.json"
    before = golden.read_bytes()
    capsys.readouterr()
    assert _bless(slow, goldens) == 2  # bad input: the user asked to replace without FORCE
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and golden.read_bytes() == before, err
    assert f"error: {golden} is already {REAL_PLAN['recipe']}'s golden (blessed from {good} at " in err
    assert "step_time_ms 2000.0 -> 14000.0 (+600.0%)" in err and f"make bless RUN={slow} FORCE=1 replaces it" in err
    assert _bless(slow, goldens, "--force", "1") == 0
    assert json.loads(golden.read_text())["step_time_ms"] == 14000.0


@pytest.mark.parametrize("kind", ["not a golden", "not JSON", "fifo"])
def test_bless_never_replaces_a_file_that_is_no_golden_without_force(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "COMPLETED")
    run = _submitted_run(tmp_path, preflight=False, train=_train())
    golden = tmp_path / "goldens" / f"{REAL_PLAN['recipe']}.json"
    golden.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(golden)
    else:
        golden.write_text('{"users": ["alice"]}' if kind == "not a golden" else "not json")
    capsys.readouterr()
    assert _bless(run, golden.parent) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"error: {golden}: ") and "not a golden that make bless writes: not replaced: " in err
    assert err.count("\n") == 1 and (golden.is_fifo() or "golden" not in golden.read_text())
    assert _bless(run, golden.parent, "--force", "1") == 0 and golden.is_file()


@pytest.mark.parametrize("planted", ["train.log", "submission.json"])
def test_bless_on_a_planted_fifo_is_one_line_never_a_hang(tmp_path, monkeypatch, planted, within):
    # R028 (hostile sweep 5): a FIFO *.log beside plan.json hung make bless.
    monkeypatch.setattr(nightly.slurm, "job_state", lambda job_id: "COMPLETED")
    run = _submitted_run(tmp_path, preflight=False, train=_train())
    (run / planted).unlink(missing_ok=True)
    os.mkfifo(run / planted)
    with within(20), pytest.raises(regress.BlessError) as err:
        nightly.bless_run(run, tmp_path / "goldens")
    assert f"{run / planted}: is not a regular file (a FIFO, socket or device)" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "goldens").exists()


def test_bless_bad_submission_json_is_one_line(tmp_path):
    run_dir = _submitted_run(tmp_path, preflight=False, train=_train())
    (run_dir / "submission.json").write_text("{torn")
    with pytest.raises(regress.BlessError, match=r"submission.json: .*; bless a run submitted by make submit"):
        nightly.bless_run(run_dir, tmp_path / "goldens")


def test_bless_bad_plan_json_is_one_line(tmp_path):
    d = _run_dir(tmp_path, "bad", "")
    (d / "plan.json").write_text("{not json")
    with pytest.raises(BadInput, match=r"plan.json: is not JSON .*: plan it again \(make plan\), or give RUN="):
        regress.bless(d, logparse.parse_text(""), tmp_path / "goldens", state="COMPLETED", submission={"job_id": "1"})


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


@pytest.mark.parametrize(
    ("name", "nodes", "dp", "ep"),
    [
        ("qwen3_30b_a3b_pretrain_16gpu_h100_bf16", 2, 16, 16),  # EP16·PP1 needs the full 16 GPUs
        ("qwen3_235b_a22b_pretrain_256gpu_h100_bf16", 32, 16, 32),  # EP32·PP8 = 256: the whole recipe
        ("deepseek_v3_pretrain_1024gpu_h100_bf16", 64, 32, 64),  # EP64·PP8 = 512 GPUs of the 1024
        ("gpt_oss_120b_pretrain_64gpu_h100_bf16", 4, 8, 8),  # EP8·PP4 = 32 GPUs
    ],
)
def test_nightly_shape_of_an_moe_recipe_keeps_ep_and_plans_clean(name, nodes, dp, ep):
    from overlapkit.bridge.build import make_plan

    shape = nightly.shape_for(name, submission.layout_of(name))
    assert (shape.nodes, shape.dp) == (nodes, dp)
    plan = make_plan(name, nodes=shape.nodes, sets=shape.sets)
    assert plan.report.ok, [f.message for f in plan.report.errors]
    assert plan.layout["ep"] == ep > 1 and plan.memory.fits
    on = (
        "on" if name.startswith("qwen3_235b") or name.endswith("30b_a3b_pretrain_16gpu_h100_bf16") else "off"
    )  # as NVIDIA
    assert plan.report.row("ep_a2a_overlap").state == on


def test_nightly_overrides_plan_cleanly_with_bridge():
    from overlapkit.bridge.build import make_plan

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


def test_report_shows_predicted_vs_measured_and_flags_a_run_20_percent_under(tmp_path):
    """plan.json's throughput prediction (make plan writes it) against the log's step time, before any golden."""
    for step, predicted, flagged in ((2400.0, 1800.0, True), (2000.0, 1800.0, False)):
        text = bridge_log(curve(N), [step] * N)
        d = _run_dir(tmp_path, f"run{step:.0f}", text)
        (d / "plan.json").write_text(json.dumps({**PLAN, "throughput": {"step_time_s": predicted / 1e3}}))
        entry = {"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": "1"}
        res = night_report.evaluate(entry, "COMPLETED", [d / "train.log"], tmp_path / "none", preflight_only=False)
        assert res["predicted_step_ms"] == pytest.approx(predicted)
        night = {"stamp": "20260101-000000", "cluster": "test", "preflight_only": False}
        report = night_report.render(night, [res], {})
        cell = f"{step:.0f} vs {predicted:.0f} ({predicted / step - 1:+.1%} throughput)"
        assert cell in report and "no golden yet" in report  # stands out before a golden exists
        assert ("25% under the predicted throughput" in report) is flagged and (f"**{cell}**" in report) is flagged
    old = _run_dir(tmp_path, "old", bridge_log(curve(N), [2000.0] * N))  # a plan.json from before the prediction
    res = night_report.evaluate(
        {**entry, "run_dir": str(old)}, "COMPLETED", [old / "train.log"], tmp_path / "none", False
    )
    assert res["predicted_step_ms"] is None and night_report.vs_prediction(res) == ("—", None)  # a dash, never a crash


def test_with_a_band_the_report_flags_a_run_beyond_either_edge(tmp_path):
    """plan.json's band (leave-one-out spread of comparable runs: measured/predicted step − 1 within [low, high])
    replaces the fixed 20%: an 11.1% longer step is flagged under a +10.7% edge, a 16.7% shorter one beyond a −7.1%
    edge says the calibration is stale, one inside says nothing."""
    band = {"low": -0.071, "high": 0.107, "runs": 4, "of": "4 published MoE fp8 runs"}
    for step, side in ((2000.0, "under"), (1500.0, "over"), (1850.0, None)):
        d = _run_dir(tmp_path, f"band{step:.0f}", bridge_log(curve(N), [step] * N))
        plan = {**PLAN, "throughput": {"step_time_s": 1.8, "band": band}}
        (d / "plan.json").write_text(json.dumps(plan))
        entry = {"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": "1"}
        res = night_report.evaluate(entry, "COMPLETED", [d / "train.log"], tmp_path / "none", preflight_only=False)
        assert regress.beyond_band(1800.0, step, band) == side
        note = night_report.vs_prediction(res)[1]
        assert (note is None) is (side is None)
        if side == "under":
            assert "10% under the predicted throughput" in note and "4 published MoE fp8 runs" in note
        if side == "over":
            assert "above the predicted throughput" in note and "make calibrate" in note
    assert regress.beyond_band(1800.0, 2000.0, None) is None  # without a band: 20% under, as before


WORTH = {  # plan.json's throughput.overlap_worth (sizing/worth.py), largest first
    "tp": {"row": "tp_comm_overlap", "off_step_s": 2.6, "delta_s": 0.6, "delta_pct": 30.0},
    "p2p": {"row": "overlap_p2p_comm", "off_step_s": 2.1, "delta_s": 0.1, "delta_pct": 5.0},
}


def test_a_slowdown_names_the_overlap_whose_worth_it_matches():
    assert "tp_comm_overlap off" in regress.likely_overlap(WORTH, 0.5)
    assert "overlap_p2p_comm off" in regress.likely_overlap(WORTH, 0.12)
    assert regress.likely_overlap(WORTH, 0.3) is None  # 2× one and 1/2 of the other: neither within 1.5×
    assert regress.likely_overlap(WORTH, 2.0) is None  # more than any overlap hides: something else
    assert regress.likely_overlap(WORTH, 0.0) is None and regress.likely_overlap(WORTH, -0.5) is None
    assert regress.likely_overlap(None, 0.5) is None and regress.likely_overlap({}, 0.5) is None
    hint = regress.likely_overlap(WORTH, 0.55)
    assert hint == "(+0.55 s/step) looks like tp_comm_overlap off: the plan predicts +0.6 s/step (+30.0%) without it"


def test_a_regression_against_the_golden_and_a_run_under_its_prediction_say_which_overlap(golden, tmp_path):
    slow = regress.classify(run(step=2600.0), "COMPLETED", golden, worth=WORTH)  # golden 2000 ms: +0.6 s
    assert slow.status == "regression" and any("looks like tp_comm_overlap off" in r for r in slow.reasons)
    assert not any("looks like" in r for r in regress.classify(run(step=2600.0), "COMPLETED", golden).reasons)
    text = bridge_log(curve(N), [2400.0] * N)  # 0.6 s over the prediction of 1.8 s
    d = _run_dir(tmp_path, "slow", text)
    (d / "plan.json").write_text(json.dumps({**PLAN, "throughput": {"step_time_s": 1.8, "overlap_worth": WORTH}}))
    entry = {"recipe": PLAN["recipe"], "nodes": 8, "dp": 2, "run_dir": str(d), "job_id": "1"}
    res = night_report.evaluate(entry, "COMPLETED", [d / "train.log"], tmp_path / "none", preflight_only=False)
    report = night_report.render({"stamp": "20260101-000000", "cluster": "test", "preflight_only": False}, [res], {})
    assert (
        "25% under the predicted throughput" in report
        and "the gap (+0.6 s/step) looks like tp_comm_overlap off" in report
    )


def test_a_golden_is_named_by_a_recipe_name_never_a_path(tmp_path):
    """A plan.json planted with recipe "../../x" never reads or writes a golden outside nightly/goldens (issue 43)."""
    with pytest.raises(BadInput, match=r"recipe='\.\./\.\./x'"):
        regress.load_golden("../../x", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "goldens").mkdir()
    (tmp_path / "goldens" / "llama3_8b_pretrain_8gpu_h100_bf16.json").symlink_to(tmp_path / "elsewhere" / "g.json")
    with pytest.raises(BadInput, match="outside"):
        regress.load_golden("llama3_8b_pretrain_8gpu_h100_bf16", tmp_path / "goldens")
