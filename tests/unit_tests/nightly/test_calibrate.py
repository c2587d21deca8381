"""make calibrate on run directories written as make plan writes them, with logs printed by Bridge's own
training_log (nightly_fixtures.bridge_log) at the step times a known set of constants gives: the fit recovers those
constants within RECOVER_TOL, keeps (and names) the published value of every constant these runs cannot move, and
the next make plan for that cluster predicts with the fit and says so. Expected values come from TRUE, not from the
fit."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from nightly_fixtures import bridge_log, curve

from overlapkit import paths
from overlapkit.bridge import stack
from overlapkit.errors import BadInput
from overlapkit.nightly import calibrate
from overlapkit.sizing import calibration, throughput

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
    """Six finished runs: plan.json + inputs.json as make plan writes them, and the job's log."""
    stack.import_bridge()
    from overlapkit.bridge.build import make_plan, prediction_inputs, write_run_dir

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
    plan = json.loads((runs_root / RUN0 / "plan.json").read_text())
    assert plan["cluster"] is None  # make plan's own run directories count for the cluster they are fitted for
    other = copy_run(runs_root, tmp_path, "r")
    (other / "plan.json").write_text(json.dumps(plan | {"cluster": "example-eos"}))
    assert calibrate.read_run(other, "local") == "planned for cluster example-eos"
    assert isinstance(calibrate.read_run(other, "example-eos"), calibrate.Run)


def test_a_run_counts_by_its_recorded_inputs_though_its_recipe_is_gone(runs_root, tmp_path):
    """The fit re-predicts the inputs the plan recorded, not a re-plan of today's recipes: a run of a recipe renamed
    or deleted since still counts, at the step it was planned with."""
    gone = copy_run(runs_root, tmp_path, "gone")
    edit_json(gone / "plan.json", lambda p: p.update(recipe="gone_pretrain_8gpu_h100_bf16"))
    run = calibrate.read_run(gone, "local")
    assert isinstance(run, calibrate.Run) and run.recipe == "gone_pretrain_8gpu_h100_bf16"
    assert run.inputs == calibrate.read_run(runs_root / RUN0, "local").inputs


def test_a_plain_sbatch_run_counts_by_the_log_its_job_recorded(runs_root, tmp_path):
    """make sbatch's job records its log (slurm-<job>.out, the script's --output) when it starts: that run counts."""
    run0 = runs_root / "llama3_8b_pretrain_8gpu_h100_bf16-run0"
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("plan.json", throughput.INPUTS):
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
        ["make", "-s", target, *args], cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
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


# --- hostile run directories (issue 43, hostile-sweep-5 area 2): each is skipped with its reason, the others count ---

RUN0 = R8 + "bf16-run0"
INPUTS = throughput.INPUTS
STEP_MS = re.compile(r"(elapsed time per iteration \(ms\): )([-+\d.eE]+)")


def copy_run(runs_root, where, name: str = "bad"):
    """run0's plan.json, inputs.json and log in `where`/<name>: a good run until a case spoils it."""
    run_dir = where / name
    run_dir.mkdir(parents=True)
    for f in ("plan.json", throughput.INPUTS, "train.log"):
        (run_dir / f).write_bytes((runs_root / RUN0 / f).read_bytes())
    return run_dir


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def log_steps(run_dir, value=None, scale=1.0, only=None):
    """Every iteration's step time (or iteration `only`'s) in the log set to `value`, or scaled by `scale`."""
    log = run_dir / "train.log"
    lines = log.read_text().split("\n")
    for i, line in enumerate(lines):
        if only is None or f"iteration {only:>8}/" in line:
            lines[i] = STEP_MS.sub(lambda m: m.group(1) + (value or f"{float(m.group(2)) * scale:.1f}"), line)
    log.write_text("\n".join(lines))


def log_append(run_dir, text):
    with open(run_dir / "train.log", "a") as f:
        f.write(text + "\n")


def submission(run_dir, **fields):
    (run_dir / "submission.json").write_text(json.dumps({"state": "submitted", "job_id": "7", **fields}))


def replace_by_fifo(path):
    path.unlink()
    os.mkfifo(path)


HOSTILE = {  # sweep case (and variants): how the run directory is spoiled, what its one skip line says
    "C005 negative step time": (lambda d: log_steps(d, "-5000.0"), "took -5000.0 ms"),
    "C005 one negative step among good ones": (lambda d: log_steps(d, "-5000.0", only=15), "iteration 15 took"),
    "C006 zero step time": (lambda d: log_steps(d, "0.0"), "step time ≤ 0"),
    "C007 a step no constants reach (too fast)": (lambda d: log_steps(d, "0.001"), "not a step of this plan"),
    "C008 a step no constants reach (too slow)": (lambda d: log_steps(d, "1e12"), "not a step of this plan"),
    "C008 ten times too slow": (lambda d: log_steps(d, scale=10.0), "not a step of this plan"),
    "C010 a FIFO *.log": (lambda d: os.mkfifo(d / "x.log"), "is not a regular file"),
    "C010 a directory *.log": (lambda d: (d / "x.log").mkdir(), "Is a directory"),
    "C011 a *.log linked to /dev/zero": (lambda d: (d / "x.log").symlink_to("/dev/zero"), "is not a regular file"),
    "C024 inputs.json without its workload": (lambda d: edit_json(d / INPUTS, lambda r: r.pop("w")), "lacks 'w'"),
    "C024 inputs.json's FLOPs not an object": (
        lambda d: edit_json(d / INPUTS, lambda r: r.update(flops="x")),
        "flops is 'x'",
    ),
    "C025 a size as text": (lambda d: edit_json(d / INPUTS, lambda r: r["w"].update(tp="1")), "w.tp is '1'"),
    "C025 a flag as a number": (
        lambda d: edit_json(d / INPUTS, lambda r: r["overlaps"].update(grad_reduce=1)),
        "overlaps.grad_reduce is 1",
    ),
    "C026 a size negative": (
        lambda d: edit_json(d / INPUTS, lambda r: r["w"].update(dp=-1)),
        "its inputs.json has dp=-1, its plan.json dp=4: not this plan's inputs",
    ),
    "C025 a size the model cannot price": (
        lambda d: edit_json(d / INPUTS, lambda r: r["w"]["shape"].update(layers=0)),
        "gives no step (ZeroDivisionError",
    ),
    "C025 a dtype the model does not know": (
        lambda d: edit_json(d / INPUTS, lambda r: r["w"]["shape"].update(dtype="fp4")),
        "gives no step (KeyError: 'fp4')",
    ),
    "C025 negative FLOPs": (
        lambda d: edit_json(d / INPUTS, lambda r: r["flops"].update(total=-1e15)),
        "not a step of this plan",
    ),
    "inputs.json not JSON": (lambda d: (d / INPUTS).write_text("{"), "is not JSON"),
    "a FIFO inputs.json": (lambda d: replace_by_fifo(d / INPUTS), "is not a regular file"),
    "a run planned before inputs.json was recorded": (
        lambda d: (d / INPUTS).unlink(),
        f"{INPUTS}: no such file; it should be {throughput.INPUTS_ROLE}: {throughput.INPUTS_FIX}",
    ),
    "C027 submission.json log a number": (lambda d: submission(d, log=123), "log is 123, not text"),
    "C027 submission.json experiment_dir a list": (lambda d: submission(d, experiment_dir=[1]), "not text"),
    "C028 submission.json names /etc": (
        lambda d: submission(d, experiment_dir="/etc"),
        "/etc (from submission.json) is not a nemo_run experiment directory",
    ),
    "C028 submission.json names a gone directory": (
        lambda d: submission(d, experiment_dir=str(d / "gone")),
        "no longer exists",
    ),
    "C034 a log of another global batch size": (
        lambda d: (d / "train.log").write_text((d / "train.log").read_text().replace("size:   128", "size:   256")),
        "the log's global batch size 256 != the plan's 128",
    ),
    "C034 a log of another world size": (
        lambda d: log_append(d, "using world size: 64, data-parallel size: 8"),
        "the log's world size 64 != the plan's 8",
    ),
    "C034 a log of another recipe": (
        lambda d: log_append(d, "+ python -m launch.entry --recipe llama3_70b_pretrain_64gpu_h100_bf16 --run-dir x"),
        "the log's recipe llama3_70b_pretrain_64gpu_h100_bf16 != the plan's",
    ),
    "C036 a FIFO plan.json": (lambda d: replace_by_fifo(d / "plan.json"), "is not a regular file"),
    "a FIFO submission.json": (lambda d: os.mkfifo(d / "submission.json"), "is not a regular file"),
    "the inputs of another layout than plan.json's": (
        lambda d: edit_json(d / "plan.json", lambda p: p["layout"].update(mbs=2)),
        "its inputs.json has mbs=1, its plan.json mbs=2: not this plan's inputs",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_bad_run_directory_is_skipped_with_its_reason(runs_root, tmp_path, case, within):
    spoil, says = HOSTILE[case]
    bad = copy_run(runs_root, tmp_path)
    assert isinstance(calibrate.read_run(bad, "local"), calibrate.Run)  # good until spoiled
    spoil(bad)
    with within(10):
        why = calibrate.read_run(bad, "local")
    assert isinstance(why, str) and says in why and "\n" not in why, why
    assert "Traceback" not in why


def test_bad_run_directories_never_abort_the_others(runs_root, tmp_path, within):
    """Every hostile run at once beside the six good ones: make calibrate fits the six and names each bad one."""
    bad = tmp_path / "bad"
    for i, (spoil, _) in enumerate(HOSTILE.values()):
        spoil(copy_run(runs_root, bad, f"r{i:02}"))
    with within(60):
        runs, skipped = calibrate.find_runs([runs_root, bad], "local")
    assert len(runs) == len(RUNS)
    for i, (_, says) in enumerate(HOSTILE.values()):
        mine = [s for s in skipped if s.startswith(f"{bad / f'r{i:02}'}: ")]
        assert len(mine) == 1 and says in mine[0], (i, mine)


def test_an_iteration_number_past_int64_is_no_iteration_and_the_run_counts(runs_root, tmp_path):
    """C035: a 5000-digit iteration (or total) is no iteration line: no int-digit-limit traceback, the run counts."""
    run = copy_run(runs_root, tmp_path)
    log_append(run, f" iteration {'9' * 5000}/      20 | elapsed time per iteration (ms): 1.0 |")
    log_append(run, f" iteration        21/{'9' * 5000} | elapsed time per iteration (ms): 1.0 |")
    got = calibrate.read_run(run, "local")
    assert isinstance(got, calibrate.Run), got
    assert got.measured_s == calibrate.read_run(runs_root / RUN0, "local").measured_s


def test_only_run_directories_are_searched_not_nemo_runs_code_copies(runs_root, tmp_path, within):
    """Issue 40: nemo_run's experiment directory (its _CONFIG) holds the packaged code, whose test fixture has a
    plan.json: never searched, nor links, hidden folders, or anything deeper than a run directory is written."""
    root = tmp_path / "runs"
    copy_run(runs_root, root / "slurm" / "runs", "real")  # <job_dir>/runs/<run>, the deepest the project writes
    fixture = paths.REPO_ROOT / "tests/unit_tests/nightly/fixtures/preflight_submit_run"
    exp = root / "nemo_run" / "experiments" / "t" / "t_1"
    code = exp / "train" / "code" / "tests" / "unit_tests" / "nightly" / "fixtures" / "preflight_submit_run"
    shutil.copytree(fixture, code)
    (exp / "_CONFIG").write_text("{}")
    shutil.copytree(fixture, root / "nemo_run" / "experiments" / "t" / "t_2" / "train" / "code" / "fixture")
    shutil.copytree(fixture, root / ".hidden" / "x")
    (root / "link").symlink_to(runs_root)
    with within(30):
        runs, skipped = calibrate.find_runs([root], "local")
    assert [r.run_dir.name for r in runs] == ["real"] and skipped == []


def test_runs_at_the_filesystem_root_are_searched_in_seconds_and_unreadable_folders_said(tmp_path, within):
    """C013: RUNS=/ walks a bounded depth, and a folder it cannot list (/proc/1/map_files, even for root) is one
    line of the report, not a PermissionError."""
    with within(30):
        found, unreadable = calibrate.run_dirs(Path("/"))
    assert all(len(d.parts) <= calibrate.MAX_DEPTH + 1 for d in found)
    if os.path.isdir("/proc/1/map_files") and not os.access("/proc/1/map_files", os.R_OK | os.X_OK):
        assert any(u.startswith("/proc/1/map_files") for u in unreadable)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    found, unreadable = calibrate.run_dirs(tmp_path)
    assert found == [] and unreadable == ([] if os.geteuid() == 0 else [f"{locked} (Permission denied)"])


def calibrate_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """make calibrate's command in this process (commands.call: check, then run), its exit status and output."""
    from launch import commands

    capsys.readouterr()
    code = commands.call("calibrate", list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_fit_no_constants_explain_is_refused_and_nothing_is_written(runs_root, tmp_path, capsys, monkeypatch):
    """C007/C008: a run the fit misses by more than calibration.MAX_ERROR (here by +90%, each run alone plausible)
    refuses the whole fit: exit 2, one line naming the run and the fix, the previous calibration kept."""
    monkeypatch.setenv(calibration.DIR_VAR, str(tmp_path / "cal"))
    root = tmp_path / "runs"
    for i in range(len(RUNS)):
        (root / f"r{i}").mkdir(parents=True)
        for f in ("plan.json", INPUTS, "train.log"):
            (root / f"r{i}" / f).write_bytes((runs_root / f"{RUNS[i][0]}-run{i}" / f).read_bytes())
    code, out, err = calibrate_in_process(capsys, "--cluster", "local", "--runs", str(root))
    assert code == 0 and "written to" in out, err
    before = (tmp_path / "cal" / "local.json").read_bytes()
    log_steps(root / "r1", scale=1.9)
    code, out, err = calibrate_in_process(capsys, "--cluster", "local", "--runs", str(root))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: fit refused, "), err
    assert "run r1's leave-one-out error is +" in err and "leave that run out of RUNS" in err
    assert "fit not written" in out and "Traceback" not in out + err
    assert (tmp_path / "cal" / "local.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "cal").iterdir()) == ["local.json"]


def test_a_profile_name_that_is_a_path_writes_nothing(runs_root, tmp_path, capsys, monkeypatch):
    """C014: a profile whose `name` climbs out of runs/calibration (it wrote over a nightly golden): exit 2, one
    line, the file it pointed at untouched."""
    cal = tmp_path / "a" / "b" / "calibration"
    monkeypatch.setenv(calibration.DIR_VAR, str(cal))
    precious = tmp_path / "escaped.json"
    precious.write_text('{"precious user config": true}\n')
    local = (paths.REPO_ROOT / "slurm" / "profiles" / "local.toml").read_text()
    evil = tmp_path / "evil.toml"
    evil.write_text(f'name = "../../../escaped"\n{local}')
    code, out, err = calibrate_in_process(capsys, "--cluster", str(evil), "--runs", str(runs_root))
    assert code == 2 and err.count("\n") == 1 and "name" in err and "Traceback" not in err, err
    assert precious.read_text() == '{"precious user config": true}\n' and not cal.exists()


def test_runs_as_one_directory_with_a_space_or_a_list(runs_root, tmp_path):
    """C029: RUNS="<dir>/my runs" is that directory; a list that names a missing one says RUNS is split at spaces."""
    from launch import calibrate as cmd

    spaced = tmp_path / "my runs"
    spaced.mkdir()
    args = cmd.parse(["--runs", str(spaced)])
    assert cmd.check(args) is False and args.roots == [spaced]  # False: the fit needs no Bridge (nor a plan server)
    args = cmd.parse(["--runs", f"{runs_root} {tmp_path / 'my'}"])
    with pytest.raises(BadInput, match=r"no directory '.*/my' \(RUNS is split at spaces\)"):
        cmd.check(args)


def test_make_plan_refuses_a_broken_calibration_with_the_fix(tmp_path, capsys, monkeypatch, within):
    """C009/C021/C018 as make plan meets them: the plan is refused (exit 2, one line naming the file and the fix),
    never printed with an absurd band, never hung."""
    from launch import commands

    monkeypatch.setenv(calibration.DIR_VAR, str(tmp_path))
    good = calibration.Calibration(label="local fitted on 3 runs on 2026-12-03")
    calibration.save("local", good, [], tmp_path)
    data = json.loads((tmp_path / "local.json").read_text())
    data["bands"]["dense bf16"]["high"] = 2484998785992.1
    (tmp_path / "local.json").write_text(json.dumps(data))
    for spoil in (None, lambda p: (p.unlink(), os.mkfifo(p))):
        if spoil:
            spoil(tmp_path / "local.json")
        capsys.readouterr()
        with within(120):
            code = commands.call("plan", [R8 + "bf16", "--cluster", "local", "--runs", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "local.json" in err and calibration.FIX in err, err
