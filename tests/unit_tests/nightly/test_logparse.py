"""The training-log parser on logs printed by Bridge's own training_log() (see nightly_fixtures.py), plus the cases a
nightly meets: interleaved ranks, torn lines, NaN/inf, a job killed mid-line, a run that never started, and
Megatron-LM's line format; what the log states about its launch; and make parse-log streaming a large log in
bounded memory with the JSON the in-process parse gives."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nightly_fixtures import bridge_log, curve, renumbered_log

from overlapkit import paths
from overlapkit.nightly import logparse

N = 30


@pytest.fixture(scope="module")
def text() -> str:
    losses = curve(N)
    times = [5000.0, 3000.0] + [2000.0 + (i % 3) for i in range(N - 2)]
    return bridge_log(losses, times, tflops=[100.0, 300.0] + [400.0] * (N - 2), memory_gb={"peak": 61.5})


def test_bridge_lines_parse_field_by_field(text):
    p = logparse.parse_text(text)
    assert [r["iteration"] for r in p["iterations"]] == list(range(1, N + 1))
    first = p["iterations"][0]
    assert first["train_iters"] == N and first["step_time_ms"] == 5000.0 and first["tflops_per_gpu"] == 100.0
    assert first["lm_loss"] == pytest.approx(11.0, rel=1e-6) and first["grad_norm"] == 2.5
    assert first["loss_scale"] == 1.0 and first["global_batch_size"] == 256 and first["complete"]
    assert first["skipped"] == 0 and first["nan_iters"] == 0


def test_summary_skips_warmup_and_reads_peak_memory(text):
    s = logparse.parse_text(text)["summary"]
    assert s["warmup_skipped"] == logparse.WARMUP_ITERS and s["steady_iterations"] == N - logparse.WARMUP_ITERS
    assert 2000.0 <= s["step_time_ms"] <= 2002.0  # the 5 s / 3 s warm-up steps are not in the mean
    assert s["tflops_per_gpu"] == pytest.approx(400.0)
    assert s["last_loss"] == pytest.approx(curve(N)[-1], rel=1e-6)
    assert s["nan_iterations"] == 0 and s["peak_mem_gb"] == 61.5 and s["incomplete_lines"] == 0


def test_interleaved_rank_prefixes_and_other_ranks_output(text):
    noisy = []
    for i, line in enumerate(text.splitlines()):
        noisy.append(f"{63 if i % 2 else 0}: {line}" if i % 3 else f"[rank63]:{line}")
        noisy.append(f"[rank{i % 8}]: WARNING some other rank's message | with: 1.0 | pipes |")
    assert logparse.parse_text("\n".join(noisy) + "\n")["summary"] == logparse.parse_text(text)["summary"]


def test_torn_line_keeps_only_terminated_fields(text):
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if "iteration       20/" in ln)
    cut = lines[k].index("lm loss: ") + len("lm loss: 7.5")  # mid-number, then another rank's output
    lines[k : k + 1] = [lines[k][:cut] + "[rank3]: NCCL INFO comm 0x1 rank 3", lines[k][cut:]]
    rec = next(r for r in logparse.parse_text("\n".join(lines))["iterations"] if r["iteration"] == 20)
    assert "lm_loss" not in rec and rec["step_time_ms"] > 0 and not rec["complete"]


def test_nan_loss_as_bridge_prints_it_and_as_megatron_lm_prints_it():
    losses = curve(12)
    losses[5] = float("nan")
    bridge = bridge_log(losses, [2000.0] * 12)
    assert "| lm loss:" not in bridge.splitlines()[[i for i, ln in enumerate(bridge.splitlines())
                                                   if "iteration        6/" in ln][0]]  # fmt: skip
    assert logparse.parse_text(bridge)["summary"]["nan_iterations"] == 1  # Bridge omits a NaN loss from the line
    for bad in ("nan", "inf", "-inf"):
        line = f" iteration        3/      10 | elapsed time per iteration (ms): 2000.0 | lm loss: {bad} |"
        p = logparse.parse_text(line + " number of nan iterations:   0 |\n")
        assert p["summary"]["nan_iterations"] == 1 and not math.isfinite(p["iterations"][0]["lm_loss"])
    assert json.loads(logparse.to_json(p))["iterations"][0]["lm_loss"] == "-inf"  # JSON has no inf


def test_killed_mid_line_drops_the_half_printed_number(text):
    k = text.index("iteration       25/")
    end = text.index("elapsed time per iteration (ms): ", k) + len("elapsed time per iteration (ms): 20")
    p = logparse.parse_text(text[:end])  # no newline: the job died while printing
    last = p["iterations"][-1]
    assert last["iteration"] == 25 and "step_time_ms" not in last and not last["complete"]
    assert p["summary"]["incomplete_lines"] == 1 and p["summary"]["last_iteration"] == 25


def test_run_that_never_reached_the_first_iteration():
    p = logparse.parse_text("> building GPT model ...\nsrun: error: node3: task 17: Killed\n")
    s = p["summary"]
    assert p["iterations"] == [] and s["iterations"] == 0 and s["step_time_ms"] is None and s["last_loss"] is None


def test_megatron_lm_format_and_mb_memory():
    # Megatron-LM (megatron/training/training.py training_log, report_memory) is not installed here, so these lines
    # follow its format strings: the same iteration fields, and memory in MB.
    lines = [
        f" [2026-01-01 00:00:{i:02d}] iteration {i:8d}/      20 | consumed samples: {i * 64:12d} | elapsed time per "
        f"iteration (ms): {1500.0 + i:.1f} | throughput per GPU (TFLOP/s/GPU): 450.0 | learning rate: 3.000000E-04 |"
        f" global batch size:    64 | lm loss: {10.0 - i * 0.1:.6E} | loss scale: 1.0 | grad norm: 1.234 |"
        " number of skipped iterations:   0 | number of nan iterations:   0 |"
        for i in range(1, 21)
    ]
    lines.insert(2, "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1024.0 | max allocated: 40960.0 | "
                    "reserved: 2048.0 | max reserved: 45000.0")  # fmt: skip
    s = logparse.parse_text("\n".join(lines) + "\n")["summary"]
    assert s["iterations"] == 20 and s["peak_mem_gb"] == pytest.approx(40.0) and s["tflops_per_gpu"] == 450.0
    assert s["step_time_ms"] == pytest.approx(1500.0 + sum(range(11, 21)) / 10)


def test_fatal_and_infrastructure_text_is_recorded():
    log = (
        "[rank5]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "[rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL\n"
        "slurmstepd: error: *** JOB 42 ON node3 CANCELLED AT 2026-01-01T00:00:00 DUE TO NODE FAILURE ***\n"
    )
    assert set(logparse.parse_text(log)["events"]) == {"illegal_memory_access", "nccl_watchdog_timeout", "node_fail"}


def test_make_parse_log_prints_json(tmp_path, text):
    log = tmp_path / "train.log"
    log.write_text(text)
    out = subprocess.run(["make", "-s", "parse-log", f"LOG={log}"], cwd=paths.REPO_ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["iterations"]) == N and data["summary"]["peak_mem_gb"] == 61.5


def test_a_restarted_job_keeps_the_last_whole_line_per_iteration_and_streams_the_same_json(text, tmp_path):
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if "iteration       20/" in ln)
    again = [ln.replace("| lm loss:", "| lm loss: 1.0 | x:") for ln in lines[k:]]  # the restart's lines differ
    torn = lines[k][: lines[k].index("grad norm")]  # a torn copy of 20 after its whole one: the whole one stays
    log = tmp_path / "restarted.log"
    log.write_text("\n".join(lines + again + [torn]))
    p = logparse.parse_files([log])
    by_it = {r["iteration"]: r for r in p["iterations"]}
    assert len(by_it) == N and by_it[20]["complete"] and by_it[21]["lm_loss"] == 1.0 and by_it[19]["lm_loss"] != 1.0
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    cli = [sys.executable, "-m", "launch", "parse-log", str(log)]
    out = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout == logparse.to_json(p) + "\n", out.stderr


REAL_RECIPE = "llama3_8b_pretrain_8gpu_h100_fp8cs"


def test_launch_facts_from_real_job_logs(text):
    fixture = Path(__file__).parent / "fixtures" / "preflight_submit_run"
    job = "".join((fixture / f).read_text() for f in ("sbatch_root-root.train_8.out", "log-root-root.train_8_0.out"))
    launch = logparse.parse_text(job + text)["launch"]  # nemo_run's sbatch trace, our preflight line, Bridge's lines
    assert launch == {"recipes": [REAL_RECIPE], "world_sizes": [8], "global_batch_sizes": [256]}
    other = ("> initialized HyperCommGrid with tp=4, pp=2, cp=2, dp=4\nusing world size: 64, data-parallel size: 4\n"
             "usage: launch.entry [-h] --recipe RECIPE --run-dir RUN_DIR\n")  # fmt: skip
    assert logparse.parse_text(other)["launch"] == {"recipes": [], "world_sizes": [64], "global_batch_sizes": []}


def test_every_event_pattern_is_behind_a_hint():
    # The hints let a line skip the event searches: each literal alternative of each pattern must contain one.
    for rx in logparse.EVENTS.values():
        for alt in rx.pattern.split("|"):
            assert any(h in alt.lower() for h in logparse._EVENT_HINTS), alt


# Runs the parser and prints its exit status and peak RSS (kB, wait4). An intermediate process because Linux keeps a
# forked child's pre-exec peak in its ru_maxrss: a direct child of this pytest (Bridge imported, > 1 GB) would report
# pytest's peak, not its own.
MEASURE = """import os, subprocess, sys
with open(sys.argv[2], "w") as out:
    child = subprocess.Popen([sys.executable, "-m", "launch", "parse-log", sys.argv[1]], stdout=out)
    _, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def test_make_parse_log_streams_a_large_log_in_bounded_memory(tmp_path, text):
    # ~30 MB of Bridge's own lines (~70k iterations): the whole-file parse held ~10x the log; the stream holds
    # neither the log nor its records, whatever the size. The interpreter itself counts.
    log, out = tmp_path / "big.log", tmp_path / "out.json"
    n = renumbered_log(text, log, 30_000_000)
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", MEASURE, str(log), str(out)], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    rc, maxrss_kb = map(int, run.stdout.split())
    assert rc == 0, run.stderr
    assert maxrss_kb / 1024 < 100, f"peak RSS {maxrss_kb / 1024:.0f} MB parsing {n} iterations"
    parsed = logparse.parse_files([log])
    assert parsed["summary"]["iterations"] == n and parsed["summary"]["peak_mem_gb"] == 61.5
    assert out.read_text() == logparse.to_json(parsed) + "\n"


def test_parse_log_imports_neither_torch_nor_bridge():
    code = ("import sys, launch.commands, launch.parse_log; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'nemo_run'}))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_parse_log_bad_input_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    for args in ([str(tmp_path / "missing.log")], [str(tmp_path)], [str(tmp_path), "--warmup", "-1"]):
        out = subprocess.run([sys.executable, "-m", "launch", "parse-log", *args], capture_output=True,
                             text=True, env=env, timeout=60)  # fmt: skip
        assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.count("error:") == 1, out.stderr


def test_parse_log_that_finds_no_iteration_says_so_in_one_line_and_fails(tmp_path):
    """A newline-free file (the issue's was 190 MB; 3 line bounds here) is read in LINE_LIMIT pieces, not whole; a log
    with no iteration line prints no JSON, names the format it expected, and what the log does report."""
    flat, crashed = tmp_path / "flat.log", tmp_path / "crashed.log"
    with flat.open("w") as f:
        for _ in range(3):
            f.write("x" * logparse.LINE_LIMIT)
    crashed.write_text("setting up\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(flat), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    rc, maxrss_kb = map(int, run.stdout.split())
    assert rc == 1 and maxrss_kb / 1024 < 100 and (tmp_path / "out.json").read_text() == ""
    for log, also in [(flat, "): give"), (crashed, "; it reports cuda_oom before any iteration: give")]:
        out = subprocess.run(
            [sys.executable, "-m", "launch", "parse-log", f"--log={log}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 1 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith(f"error: LOG={log}: no training iterations found") and also in out.stderr


def test_a_log_path_starting_with_a_dash_is_a_path(tmp_path):
    (tmp_path / "--help").write_text(" iteration        1/       2 | consumed samples:           8 |\n")
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "launch", "parse-log", "--log=--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and json.loads(out.stdout)["summary"]["iterations"] == 1, out.stderr
