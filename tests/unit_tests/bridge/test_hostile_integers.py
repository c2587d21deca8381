"""Integers typed or logged with thousands of digits (the hostile sweep's S009, S010, M058, M059, M062, L001, L002):
every surface reads them through one rule (jsonio.integer: digits counted before int(), within int64), so Python's
4300-digit limit is never reached and the answer is one line naming the fix, exit 2, before any work; a log's
iteration line past int64 is no iteration. In process (the Makefile's own command lines through the dispatcher)."""

from __future__ import annotations

import sys
import time

import pytest

from overlapkit import jsonio
from overlapkit.nightly import logparse

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
HUGE = "9" * 5000  # past sys.get_int_max_str_digits() (4300)
ZEROS = "0" * 5000 + "7"  # 5,001 digits, the value 7: leading zeros count towards the limit too


def test_the_limit_is_real_here():
    assert sys.get_int_max_str_digits() < len(HUGE)  # int(HUGE) would raise ValueError: what every case guards


@pytest.mark.parametrize(
    ("text", "value"),
    [(HUGE, None), ("-" + HUGE, None), (ZEROS, 7), (str(2**63 - 1), 2**63 - 1), (str(2**63), None)]
    + [("-" + str(2**63), -(2**63)), ("١٢", None), ("²", None), ("", None), ("-", None), ("+1", None), (" 1", None)],
)
def test_one_reading_of_an_integer(text, value):
    t0 = time.monotonic()
    assert jsonio.integer(text) == value
    assert time.monotonic() - t0 < 0.1


@pytest.mark.parametrize(
    ("target", "variables", "start"),
    [
        ("submit", ["TORCH_PROFILE=3:5", f"TORCH_PROFILE_RANKS={HUGE}"], "error: TORCH_PROFILE_RANKS='999"),  # S009
        ("submit", [f"TORCH_PROFILE=1:{HUGE}"], "error: TORCH_PROFILE='1:999"),  # S010
        ("submit", [f"TORCH_PROFILE={HUGE}:{HUGE}1"], "error: TORCH_PROFILE='999"),
        ("plan", [f"NSYS=3:{ZEROS}{HUGE}"], "error: NSYS='3:000"),
        ("sbatch", ["NSYS=3:5", f"NSYS_RANKS=0,{HUGE}"], "error: NSYS_RANKS='0,999"),
        ("plan", [f"NODES={HUGE}"], "error: NODES='999"),  # M058
        ("plan", [f"NODES={ZEROS}{HUGE}"], "error: NODES='000"),
        ("submit", ["DRYRUN=1", f"SEGMENTS={HUGE}"], "error: SEGMENTS='999"),  # M062
        ("plan", [f"SET=train.train_iters={HUGE}"], "error: train.train_iters='999"),  # M059
        ("plan", [f"SET=train.train_iters=-{HUGE}"], "error: train.train_iters='-999"),
        ("plan", [f"SET=train.train_iters=1_{HUGE}"], "error: train.train_iters='1_999"),
        ("plan", [f"SET=train.train_iters=1:{HUGE}"], "error: train.train_iters='1:999"),  # YAML 1.1's base 60
    ],
)
def test_thousands_of_digits_are_one_line_before_any_work(make_here, target, variables, start):
    t0 = time.monotonic()
    code, out, err = make_here(target, f"RECIPE={R8}", *variables)
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith(start), err[:300]
    assert "Traceback" not in err and "int_max_str_digits" not in err
    assert time.monotonic() - t0 < 10


def test_a_set_list_of_huge_integers_is_refused_too():
    from overlapkit.bridge import overrides

    with pytest.raises(overrides.OverrideError, match=r"beyond the 64-bit integers Megatron stores"):
        overrides.convert_kinds("model.some_list", f"[1, {HUGE}]", {"list"})
    assert overrides.convert_kinds("model.some_list", f"[1, {ZEROS}]", {"list"}) == [1, 7]  # YAML 1.1: octal 07


def _log(iteration: str, total: str) -> str:
    good = " iteration        1/       2 | elapsed time per iteration (ms): 10.0 | nan iterations: 0 |\n"
    return good + f" iteration {iteration}/ {total} | elapsed time per iteration (ms): 20.0 | nan iterations: 0 |\n"


@pytest.mark.parametrize(
    ("iteration", "total"),
    [("2", HUGE), (HUGE, "2"), (str(2**63), "2"), (ZEROS + HUGE, "2")],  # L002, L001, past int64, zero-led
)
def test_a_log_iteration_past_int64_is_no_iteration(tmp_path, make_here, iteration, total):
    t0 = time.monotonic()
    parsed = logparse.parse_text(_log(iteration, total))
    assert [r["iteration"] for r in parsed["iterations"]] == [1]
    memory = f"[Rank {HUGE}] (after 2 iterations) memory (GB) | peak: 1.0 |\nusing world size: {HUGE}\n"
    assert logparse.parse_text(_log("2", "2") + memory)["memory"] == []
    log = tmp_path / "big.log"
    log.write_text(_log(iteration, total))
    code, out, err = make_here("parse-log", f"LOG={log}")  # make parse-log: the JSON of the one iteration
    assert code == 0 and '"iteration": 1' in out and "Traceback" not in err
    assert time.monotonic() - t0 < 10
