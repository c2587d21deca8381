"""Parse a Megatron Bridge (or Megatron-LM) training log into per-iteration records and a summary.

The format is Bridge 0.6.2's own, read from `megatron/bridge/training/utils/train_utils.py`:

* `training_log()` builds one line per log interval and prints it with `print_rank_last`:
  `" [%Y-%m-%d %H:%M:%S] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} |"`
  `" throughput per GPU (TFLOP/s/GPU): {:.1f} |"` (only with logger.log_throughput), `" learning rate: {:.6E} |"`,
  `" global batch size: {:5d} |"`, one `" {key}: {:.6E} |"` per loss (`lm loss`) — **only if avg >= 0.0, so a NaN
  loss is silently left out of the line** —, `" loss scale: {:.1f} |"`, `" grad norm: {:.3f} |"`,
  `" number of skipped iterations: {:3d} |"`, `" number of nan iterations: {:3d} |"`.
  Every field ends with `" |"`; Megatron-LM's `training.py` `training_log` prints the same fields.
* The memory report (first iterations, `report_memory_flag`):
  `"[Rank {r}] (after {it} iterations) memory (GB) | mem-allocated-gigabytes: v | ... | mem-max-allocated-gigabytes: v
  | ..."` from `report_memory()` (MEMORY_KEYS, bytes → GB). Megatron-LM prints `memory (MB) | ... | max allocated: v`.

Robustness rules (why): a field is trusted only when its `|` terminator follows it, so a line cut by a killed job or
torn by another rank's output never yields a half-printed number; rank prefixes (`0: `, `[rank0]:`, `[default0]:`)
are ignored because the iteration header is searched anywhere in the line; a repeated iteration (a restarted job
appending to the same log) keeps its last occurrence.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

# The first iterations pay one-off costs (NCCL communicator and userbuffers set-up, allocator growth, kernel
# autotuning, the first param all-gather), so steady-state numbers skip them.
WARMUP_ITERS = 10

_ITER = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \((GB|MB)\)(.*)$")
_NUM = r"[-+]?(?:nan|inf|infinity|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_FIELD = re.compile(rf"^\s*([A-Za-z][A-Za-z0-9 /()\-_.]*?):\s*({_NUM})\s*$", re.IGNORECASE)
FIELDS = {  # Bridge/Megatron label -> our key
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "step_time_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan_iters",
}
LAST_FIELD = "nan_iters"  # Bridge prints it last: a line that has it was printed whole
# Text that decides a run's fate (regress.py classifies). Sources: CUDA's error string, torch ProcessGroupNCCL's
# watchdog messages, torch.OutOfMemoryError, slurmstepd's cancellation banner, srun's node-failure error.
EVENTS = {
    "illegal_memory_access": re.compile(r"an illegal memory access was encountered", re.IGNORECASE),
    "nccl_watchdog_timeout": re.compile(r"Watchdog caught collective operation timeout|NCCL watchdog", re.I),
    "cuda_oom": re.compile(r"CUDA out of memory|OutOfMemoryError"),
    "node_fail": re.compile(r"DUE TO NODE FAIL|Node failure on|NODE_FAIL"),
    "preempted": re.compile(r"DUE TO PREEMPTION|PREEMPTED"),
    "time_limit": re.compile(r"DUE TO TIME LIMIT"),
}


def _num(text: str) -> float:
    return float(text)  # float() reads "nan", "inf", "-inf" as Bridge's f-strings print them


def parse_iteration_line(line: str) -> dict | None:
    m = _ITER.search(line)
    if not m:
        return None
    rec: dict = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
    # Only `|`-terminated pieces are fields: the text after the last `|` is unterminated (cut or torn).
    for piece in line[m.end() :].split("|")[:-1]:
        f = _FIELD.match(piece)
        if f and f.group(1).strip() in FIELDS:
            key = FIELDS[f.group(1).strip()]
            val = _num(f.group(2))
            rec[key] = int(val) if key in ("consumed_samples", "global_batch_size", "skipped", "nan_iters") else val
    rec["complete"] = LAST_FIELD in rec
    return rec


def parse_memory_line(line: str, terminated: bool) -> dict | None:
    m = _MEM.search(line)
    if not m:
        return None
    pieces = m.group(4).split("|")[1:]
    if not terminated and pieces:
        pieces = pieces[:-1]  # the last value of a cut line may be missing digits
    values = {}
    for piece in pieces:
        f = _FIELD.match(piece)
        if f:
            v = _num(f.group(2))
            values[f.group(1).strip()] = v / 1024.0 if m.group(3) == "MB" else v
    return {"rank": int(m.group(1)), "after": int(m.group(2)), "gb": values}


def _peak(mem: list[dict]) -> float | None:
    # Bridge: mem-max-allocated-gigabytes; Megatron-LM: "max allocated" (MB, converted above).
    vals = [v for r in mem for k, v in r["gb"].items() if k in ("mem-max-allocated-gigabytes", "max allocated")]
    return max(vals) if vals else None


def parse_text(text: str, warmup: int = WARMUP_ITERS) -> dict:
    lines = text.split("\n")
    by_iter: dict[int, dict] = {}
    memory, events = [], {}
    for i, line in enumerate(lines):
        terminated = i < len(lines) - 1  # the final piece has no newline: the job may have died mid-print
        rec = parse_iteration_line(line)
        if rec is not None:
            old = by_iter.get(rec["iteration"])
            if old is None or rec["complete"] or not old["complete"]:
                by_iter[rec["iteration"]] = rec
        elif (mem := parse_memory_line(line, terminated)) is not None:
            memory.append(mem)
        for name, rx in EVENTS.items():
            if name not in events and rx.search(line):
                events[name] = line.strip()[:300]
    iters = [by_iter[k] for k in sorted(by_iter)]
    return {"iterations": iters, "memory": memory, "events": events, "summary": summarize(iters, memory, warmup)}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(iters: list[dict], memory: list[dict], warmup: int = WARMUP_ITERS) -> dict:
    # With fewer iterations than the warm-up, the second half is the best steady-state estimate there is.
    skip = warmup if len(iters) > warmup else len(iters) // 2
    steady = [r for r in iters if r["iteration"] > (iters[skip - 1]["iteration"] if skip else 0)]
    times = [r["step_time_ms"] for r in steady if _finite(r.get("step_time_ms"))]
    tflops = [r["tflops_per_gpu"] for r in steady if _finite(r.get("tflops_per_gpu"))]
    losses = [r for r in iters if "lm_loss" in r]
    # Bridge leaves a NaN loss out of the line and counts it in "number of nan iterations"; Megatron-LM builds
    # may print "lm loss: nan". Count both, plus a complete line with no loss at all (the NaN case in Bridge).
    nan = sum(
        1
        for r in iters
        if r.get("nan_iters", 0) > 0
        or ("lm_loss" in r and not math.isfinite(r["lm_loss"]))
        or (r["complete"] and "lm_loss" not in r and losses)
        or ("grad_norm" in r and not math.isfinite(r["grad_norm"]))
    )
    return {
        "iterations": len(iters),
        "first_iteration": iters[0]["iteration"] if iters else None,
        "last_iteration": iters[-1]["iteration"] if iters else None,
        "train_iters": iters[-1]["train_iters"] if iters else None,
        "warmup_skipped": skip,
        "steady_iterations": len(times),
        "step_time_ms": _mean(times),
        "tflops_per_gpu": _mean(tflops),
        "last_loss": losses[-1]["lm_loss"] if losses else None,
        "nan_iterations": nan,
        "skipped_iterations": sum(r.get("skipped", 0) for r in iters),
        "incomplete_lines": sum(1 for r in iters if not r["complete"]),
        "peak_mem_gb": _peak(memory),
    }


def parse_file(path: Path | str, warmup: int = WARMUP_ITERS) -> dict:
    return parse_text(Path(path).read_text(errors="replace"), warmup)


def parse_files(paths, warmup: int = WARMUP_ITERS) -> dict:
    """Several logs of one job (nemo_run writes one per task group): parsed as one text."""
    return parse_text("\n".join(Path(p).read_text(errors="replace") for p in paths), warmup)


def _clean(obj):
    """JSON has no NaN/inf: write them as the strings Python prints."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def to_json(parsed: dict) -> str:
    return json.dumps(_clean(parsed), indent=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="overlapkit.regress.logparse", description="Bridge training log → JSON")
    ap.add_argument("log", type=Path)
    ap.add_argument("--warmup", type=int, default=WARMUP_ITERS)
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"error: LOG={args.log}: no such file (give LOG=<path to a training log>)", file=sys.stderr)
        return 2
    print(to_json(parse_file(args.log, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
