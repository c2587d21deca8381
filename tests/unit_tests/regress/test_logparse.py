"""The training-log parser on logs printed by Bridge's own training_log() (see nightly_fixtures.py), plus the cases a
nightly meets: interleaved ranks, torn lines, NaN/inf, a job killed mid-line, a run that never started, and
Megatron-LM's line format."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from nightly_fixtures import bridge_log, curve

from overlapkit import stack
from overlapkit.regress import logparse

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
    out = subprocess.run(["make", "-s", "parse-log", f"LOG={log}"], cwd=stack.REPO_ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["iterations"]) == N and data["summary"]["peak_mem_gb"] == 61.5
