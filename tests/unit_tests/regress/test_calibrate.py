"""make calibrate on run directories written as make plan writes them, with logs printed by Bridge's own
training_log (nightly_fixtures.bridge_log) at the step times a known set of constants gives: the fit recovers those
constants within RECOVER_TOL, keeps (and names) the published value of every constant these runs cannot move, and
the next make plan for that cluster predicts with the fit and says so. Expected values come from TRUE, not from the
fit."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess

import pytest
from nightly_fixtures import bridge_log, curve

from overlapkit import stack
from overlapkit.regress import calibrate
from overlapkit.sizing import calibration

# The constants the synthetic cluster runs at: its BF16 and FP8 GEMMs 10% slower than the published fit, its
# per-layer overhead 25% larger (another container, another NCCL); the rest as published.
TRUE = calibration.FITTED.replace(gemm_bf16=0.55, gemm_fp8=0.42, layer_overhead_s=1.5e-3)
CHANGED = ("gemm_bf16", "gemm_fp8", "layer_overhead_s")
RECOVER_TOL = 0.01  # relative: the logs print the step time to 0.1 ms
ITERS = 20  # 10 warm-up iterations (logparse.WARMUP_ITERS) and 10 steady ones
R8 = "llama3_8b_pretrain_8gpu_h100_"
RUNS = [  # (recipe, SET): layouts that tell the GEMM rates from the per-layer overhead (tokens per layer differ)
    (R8 + "bf16", ""),
    (R8 + "bf16", "model.seq_length=2048"),
    (R8 + "bf16", "model.tensor_model_parallel_size=2 model.context_parallel_size=1"),
    (R8 + "fp8cs", ""),
    (R8 + "fp8cs", "model.seq_length=2048"),
    (R8 + "fp8cs", "model.tensor_model_parallel_size=2 model.seq_length=4096"),
]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """Six finished runs: plan.json + overrides.json as make plan writes them, and the job's log."""
    stack.import_bridge()
    from overlapkit.plan.build import make_plan, prediction_inputs, write_run_dir

    root = tmp_path_factory.mktemp("runs")
    for i, (name, sets) in enumerate(RUNS):
        plan = make_plan(name, nodes=1, sets=sets, caller_env={})
        run_dir = write_run_dir(plan, root, stamp=f"run{i}")
        step_ms = prediction_inputs(plan).predict(TRUE).step_s * 1e3
        log = bridge_log(curve(ITERS), [step_ms] * ITERS, world=8, gbs=plan.cfg.train.global_batch_size)
        (run_dir / "train.log").write_text(log)
    (root / "no-log-run").mkdir()  # a plan that never ran: skipped, and said why
    (root / "no-log-run" / "plan.json").write_text("{}")
    return root


def test_the_fit_recovers_the_constants_the_runs_ran_at(runs_root):
    runs, skipped = calibrate.find_runs([runs_root], "local")
    assert len(runs) == len(RUNS) and len(skipped) == 1 and "no-log-run" in skipped[0]
    result = calibrate.calibrate(runs, "local", dt.date(2026, 12, 3))
    got = result.calibration.constants
    assert set(CHANGED) <= set(result.fitted)
    for name in calibration.NAMES:
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=RECOVER_TOL), name
    assert set(result.calibration.kept) == set(calibration.NAMES) - set(result.fitted)
    assert {"moe_token_s", "a2a_efficiency", "grouped_gemm", "blockwise"} <= set(result.calibration.kept)
    assert result.calibration.label == "local fitted on 6 runs on 2026-12-03"
    for row in result.runs:  # exact synthetic data: nothing left to explain, in or out of the fit
        assert abs(row["residual"]) < RECOVER_TOL and abs(row["leave_one_out"]) < 3 * RECOVER_TOL
    text = calibrate.report(result, runs, [], "local", runs_root / "x.json")
    assert "moe_token_s" in text and "kept at published" in text and "these runs cannot move it" in text


def test_too_few_runs_keep_the_published_constants_and_name_them(runs_root):
    runs, _ = calibrate.find_runs([runs_root], "local")
    assert calibrate.calibrate(runs[: calibrate.MIN_RUNS - 1], "local", dt.date(2026, 12, 3)) is None
    text = calibrate.report(None, runs[:2], [], "nowhere", None)
    assert "nothing fitted" in text and all(n in text for n in calibration.NAMES) and "published" in text


def test_a_run_of_another_cluster_does_not_count(runs_root, tmp_path):
    plan = json.loads((runs_root / "llama3_8b_pretrain_8gpu_h100_bf16-run0" / "plan.json").read_text())
    assert plan["cluster"] is None  # make plan's own run directories count for the cluster they are fitted for
    other = tmp_path / "r"
    other.mkdir()
    for f in ("plan.json", "overrides.json", "train.log"):
        (other / f).write_bytes((runs_root / "llama3_8b_pretrain_8gpu_h100_bf16-run0" / f).read_bytes())
    (other / "plan.json").write_text(json.dumps(plan | {"cluster": "example-eos"}))
    assert calibrate.read_run(other, "local") == "planned for cluster example-eos"
    record = json.loads((other / "overrides.json").read_text())
    (other / "overrides.json").write_text(json.dumps(record | {"recipe": "gone_pretrain_8gpu_h100_bf16"}))
    assert calibrate.read_run(other, "example-eos").startswith("its plan no longer builds: ")


def test_a_plain_sbatch_run_counts_by_the_log_its_job_recorded(runs_root, tmp_path):
    """make sbatch's job records its log (slurm-<job>.out, the script's --output) when it starts: that run counts."""
    run0 = runs_root / "llama3_8b_pretrain_8gpu_h100_bf16-run0"
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("plan.json", "overrides.json"):
        (plain / f).write_bytes((run0 / f).read_bytes())
    (plain / "slurm-7.out").write_bytes((run0 / "train.log").read_bytes())
    record = {"state": "submitted", "job_id": "7", "job_ids": ["7"], "log": str(plain / "slurm-7.out")}
    (plain / "submission.json").write_text(json.dumps(record))
    run = calibrate.read_run(plain, "local")
    assert isinstance(run, calibrate.Run), run
    assert run.measured_s == calibrate.read_run(run0, "local").measured_s


def make(target: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    """`make -s <target> <args>` in the checkout, in a new process, as a user types it."""
    return subprocess.run(
        ["make", "-s", target, *args], cwd=stack.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_make_calibrate_then_make_plan_predicts_with_the_fit(runs_root, tmp_path):
    """As a user runs it: make calibrate in a new process writes the cluster's fit; make plan for that cluster then
    predicts with it and says which calibration it used."""
    env = os.environ | {calibration.DIR_VAR: str(tmp_path / "cal")}
    done = make("calibrate", "CLUSTER=local", f"RUNS={runs_root}", env=env)
    assert done.returncode == 0, done.stderr
    assert "fitted on 6 runs" in done.stdout and "kept at published" in done.stdout
    saved = json.loads((tmp_path / "cal" / "local.json").read_text())
    assert saved["constants"]["gemm_fp8"] == pytest.approx(TRUE.gemm_fp8, rel=RECOVER_TOL)
    plan = make("plan", f"RECIPE={R8}fp8cs", "CLUSTER=local", "FORMAT=json", env=env)
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)["throughput"]
    assert out["calibration"].startswith("local fitted on 6 runs on ")
    assert out["band"]["of"].endswith("local dense fp8 runs")
    bad = make("calibrate", "CLUSTER=local", f"RUNS={tmp_path / 'none'}", env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: RUNS: no directory") and "Traceback" not in bad.stderr
