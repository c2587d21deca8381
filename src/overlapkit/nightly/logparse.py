"""A Megatron Bridge (or Megatron-LM) training log → per-iteration records, a summary, the events that decide a run's
fate and what the log says of its launch (make bless compares that with plan.json); the rules for torn, cut,
repeated and NaN lines are in docs/nightly.md ("Log parser"). Memory: the log is parsed a line at a time and only the
iteration records are kept, each packed by `marshal` (a third of a dict); `write_json` unpacks one at a time.
"""

from __future__ import annotations

import json
import marshal
import math
import re
from dataclasses import dataclass

from overlapkit import jsonio
from overlapkit.spec import runopts

WARMUP_ITERS = 10  # one-off costs (NCCL and userbuffers set-up, allocator growth, autotuning): not steady state
LINE_LIMIT = 8 << 20  # characters; a real log line is < 1 kB, so only a newline-free binary file meets it
DISTINCT_CAP = 32  # launch values kept per kind: one is normal, two already means a mixed log

# Counts are at most 19 digits (int64): a longer run of digits matches nothing, so int() never meets Python's
# digit limit (a 5000-digit "iteration" is no iteration, not a traceback).
_INT = r"\d{1,19}"
_ITER = re.compile(rf"iteration\s+({_INT})\s*/\s*({_INT})\s*\|")
_MEM = re.compile(rf"\[Rank ({_INT})\] \(after ({_INT}) iterations\) memory \((GB|MB)\)(.*)$")
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
INT_FIELDS = ("consumed_samples", "global_batch_size", "skipped", "nan_iters")
LAST_FIELD = "nan_iters"  # Bridge prints it last: a line that has it was printed whole
# Text that decides a run's fate (rules.py), as CUDA, torch (NCCL watchdog, OOM), slurmstepd and srun print it.
EVENTS = {
    "illegal_memory_access": re.compile(r"an illegal memory access was encountered", re.IGNORECASE),
    "nccl_watchdog_timeout": re.compile(r"Watchdog caught collective operation timeout|NCCL watchdog", re.I),
    "cuda_oom": re.compile(r"CUDA out of memory|OutOfMemoryError"),
    "node_fail": re.compile(r"DUE TO NODE FAIL|Node failure on|NODE_FAIL"),
    "preempted": re.compile(r"DUE TO PREEMPTION|PREEMPTED"),
    "time_limit": re.compile(r"DUE TO TIME LIMIT"),
}
# Lower-case words in every line an EVENTS pattern matches (test_logparse checks): a line with none skips the searches.
_EVENT_HINTS = ("memory", "watchdog", "node fail", "node_fail", "preempt", "time limit")
# Where the launch is stated (docs/nightly.md). A usage message names `--recipe RECIPE` too: not a launch.
_LAUNCH = re.compile(
    rf"preflight: (?:OK|FAILED) \({_INT}/(?P<preflight>{_INT}) ranks\)"
    rf"|using world size: (?P<megatron>{_INT})"
    rf"|initialized HyperCommGrid with tp=(?P<tp>{_INT}), pp=(?P<pp>{_INT}), cp=(?P<cp>{_INT}), dp=(?P<dp>{_INT})"
    r"|launch\.entry\b.*?--recipe[= ](?P<recipe>[\w.\-]+)"
    r"|/experiments/(?P<experiment>[\w.\-]+)/(?P=experiment)_\d+/"
)


def _fields(pieces) -> list[tuple[str, float]]:
    """(label, value) of each `label: number` piece; float() reads "nan", "inf", "-inf" as Bridge prints them."""
    return [(f.group(1).strip(), float(f.group(2))) for f in map(_FIELD.match, pieces) if f]


def warmup_skip(count: int, warmup: int = WARMUP_ITERS) -> int:
    """The leading iterations the summary leaves out of a log of `count`: the warm-up, or with fewer iterations than
    that the first half (the second half is the best steady-state estimate there is)."""
    return warmup if count > warmup else count // 2


def summarize(iters, memory: list[dict], warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    """The summary of `iters`, the records in iteration order (a list, or _Records); `exclude`: iterations left out
    of the step-time and TFLOP/s means (the ones an Nsight capture slowed)."""
    skip, exclude = warmup_skip(len(iters), warmup), frozenset(exclude)
    first = last = last_loss = None
    times, tflops, excluded = [], [], []
    nan = nan_if_losses = skipped = incomplete = 0
    for i, r in enumerate(iters):
        first, last = r["iteration"] if first is None else first, r
        if r["iteration"] in exclude:
            excluded.append(r["iteration"])
        elif i >= skip:  # the records are in order, one per iteration: this one is past the warm-up
            times += [r["step_time_ms"]] if math.isfinite(r.get("step_time_ms", math.nan)) else []
            tflops += [r["tflops_per_gpu"]] if math.isfinite(r.get("tflops_per_gpu", math.nan)) else []
        if "lm_loss" in r:
            last_loss = r["lm_loss"]
        # Bridge leaves a NaN loss out of the line and counts it in "number of nan iterations"; Megatron-LM may print
        # "lm loss: nan". Count both, and a complete line with no loss where other lines do print one (known at the end)
        if r.get("nan_iters", 0) > 0 or not all(map(math.isfinite, (r.get("lm_loss", 0), r.get("grad_norm", 0)))):
            nan += 1
        elif r["complete"] and "lm_loss" not in r:
            nan_if_losses += 1
        skipped += r.get("skipped", 0)
        incomplete += not r["complete"]
    # Bridge: mem-max-allocated-gigabytes; Megatron-LM: "max allocated" (MB, converted above).
    peaks = (v for m in memory for k, v in m["gb"].items() if k in ("mem-max-allocated-gigabytes", "max allocated"))
    return {
        "iterations": len(iters),
        "first_iteration": first,
        "last_iteration": (last or {}).get("iteration"),
        "train_iters": (last or {}).get("train_iters"),
        "warmup_skipped": skip,
        "steady_iterations": len(times),
        "excluded_iterations": excluded,
        "step_time_ms": sum(times) / len(times) if times else None,
        "tflops_per_gpu": sum(tflops) / len(tflops) if tflops else None,
        "last_loss": last_loss,
        "nan_iterations": nan + (nan_if_losses if last_loss is not None else 0),
        "skipped_iterations": skipped,
        "incomplete_lines": incomplete,
        "peak_mem_gb": max(peaks, default=None),
    }


def profiled_iterations(plan: dict) -> range:
    """The iterations plan.json's profiler window slowed (runopts.perturbed_iterations; none for an unprofiled run)."""
    if (planned := runopts.planned_window(plan.get("run"))) is None or not planned[1].get("steps"):
        return range(0)
    return runopts.perturbed_iterations(tuple(planned[1]["steps"]), planned[0])


@dataclass(eq=False)
class _Records(list):
    """Packed records read as a list in iteration order, one unpacked at a time (all summarize and json.dump ask)."""

    packed: dict[int, bytes]
    clean: bool = False

    def __len__(self) -> int:
        return len(self.packed)

    def __iter__(self):
        for k in sorted(self.packed):
            yield _clean(marshal.loads(self.packed[k])) if self.clean else marshal.loads(self.packed[k])


def _ints(*texts: str) -> tuple[int | None, ...]:
    """Each number a log line states (iteration, rank, world size), as jsonio reads an integer: None past int64."""
    return tuple(jsonio.integer(t) for t in texts)


def _parse(lines, warmup: int = WARMUP_ITERS, exclude=(), lazy: bool = False) -> dict:
    """The parse of `lines`, (line, whether a newline followed it) pairs; `lazy`: its iterations as _Records."""
    packed: dict[int, bytes] = {}
    memory, events = [], {}
    facts: dict[str, set] = {"recipes": set(), "world_sizes": set(), "global_batch_sizes": set()}
    for line, terminated in lines:
        fact = None
        # jsonio.integer: past int64 (Megatron's counters) is no iteration, and never reaches Python's digit limit
        if "iteration" in line and (m := _ITER.search(line)) and None not in (n := _ints(m.group(1), m.group(2))):
            rec: dict = {"iteration": n[0], "train_iters": n[1]}
            # Only `|`-terminated pieces are fields: the text after the last `|` is unterminated (cut or torn).
            for label, val in _fields(line[m.end() :].split("|")[:-1]):
                if (key := FIELDS.get(label)) and key not in INT_FIELDS:
                    rec[key] = val
                elif key and math.isfinite(val):  # a count printed as nan/inf is no count
                    rec[key] = int(val)
            rec["complete"] = LAST_FIELD in rec
            old = packed.get(rec["iteration"])
            if rec["complete"] or old is None or not marshal.loads(old)["complete"]:
                packed[rec["iteration"]] = marshal.dumps(rec)  # the last wins, but never a torn line over a whole one
            if "global_batch_size" in rec:
                fact = "global_batch_sizes", rec["global_batch_size"]
        elif "[Rank " in line and (m := _MEM.search(line)) and None not in (n := _ints(m.group(1), m.group(2))):
            pieces = m.group(4).split("|")[1 : None if terminated else -1]  # a cut line's last value may miss digits
            values = {label: v / 1024.0 if m.group(3) == "MB" else v for label, v in _fields(pieces)}
            memory.append({"rank": n[0], "after": n[1], "gb": values})
        elif m := _LAUNCH.search(line):  # the launch's world size or recipe
            g = m.groupdict()
            if g["preflight"] or g["megatron"] or g["tp"]:
                sizes = _ints(g["tp"], g["pp"], g["cp"], g["dp"]) if g["tp"] else _ints(g["preflight"] or g["megatron"])
                fact = ("world_sizes", math.prod(sizes)) if None not in sizes else None
            elif not (g["recipe"] and "usage:" in line):
                fact = "recipes", g["recipe"] or g["experiment"]
        if fact and len(facts[fact[0]]) < DISTINCT_CAP:
            facts[fact[0]].add(fact[1])
        low = line.lower()
        if len(events) < len(EVENTS) and any(h in low for h in _EVENT_HINTS):
            events |= {
                name: line.strip()[:300] for name, rx in EVENTS.items() if name not in events and rx.search(line)
            }
    return {
        "iterations": _Records(packed) if lazy else list(_Records(packed)),
        "memory": memory,
        "events": events,
        "summary": summarize(_Records(packed), memory, warmup, exclude),
        "launch": {k: sorted(v) for k, v in facts.items()},
    }


def parse_text(text: str, warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    lines = text.split("\n")  # "\n" only, as always: a "\r" stays part of its line here
    return _parse(((line, i < len(lines) - 1) for i, line in enumerate(lines)), warmup, exclude)  # last: no "\n"


def parse_files(paths, warmup: int = WARMUP_ITERS, exclude=(), lazy: bool = False) -> dict:
    """Logs of one job (nemo_run writes one per task group) as one text, each file but the last ending in a newline;
    a FIFO, device or a file past the log ceiling is one Unreadable (jsonio's guarded reader), never a hang."""
    paths = list(paths)

    def lines():
        for i, path in enumerate(paths):
            with jsonio.open_text(path, jsonio.LOG_LIMIT) as f:
                for raw in iter(lambda f=f: f.readline(LINE_LIMIT), ""):
                    whole = raw.endswith("\n")
                    yield raw[:-1] if whole else raw, whole or i < len(paths) - 1

    return _parse(lines(), warmup, exclude, lazy)


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


def write_json(parsed: dict, out) -> None:
    """`to_json(parsed)` and a newline written to `out` one record at a time (`parsed`: parse_files(lazy=True))."""
    records = _Records(parsed["iterations"].packed, clean=True)
    json.dump({k: records if k == "iterations" else _clean(v) for k, v in parsed.items()}, out, indent=2)
    out.write("\n")
