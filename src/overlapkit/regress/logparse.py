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
* What the log says about its launch (`launch` in the output; make bless compares it with plan.json): the global
  batch size of every iteration line; the world size from our entry point's `preflight: OK (8/8 ranks)`, Bridge's
  `> initialized HyperCommGrid with tp=, pp=, cp=, dp=` or Megatron-LM's `using world size: N`; the recipe from a
  traced `launch.entry ... --recipe NAME` command or nemo_run's experiment path `/experiments/NAME/NAME_<id>/` (the
  sbatch output traces the srun line that holds it).

Robustness rules (why): a field is trusted only when its `|` terminator follows it, so a line cut by a killed job or
torn by another rank's output never yields a half-printed number; rank prefixes (`0: `, `[rank0]:`, `[default0]:`)
are ignored because the iteration header is searched anywhere in the line; a repeated iteration (a restarted job
appending to the same log) keeps its last occurrence.

Memory is bounded whatever the log's size (`make parse-log` on a 228 MB log once held 2.3 GB): the log is read one
line at a time, and the records go to a private temporary SQLite database (SQLite's page cache while small, a temp
file under $TMPDIR when large), which also does the last-occurrence rule and the ordering by iteration. The CLI
writes the JSON piece by piece from there, byte for byte what `to_json(parse_file(log))` prints. parse_text/
parse_file/parse_files return the whole dict, so an in-process caller holds every record (a nightly run has 60).
Bounds: a line longer than LINE_LIMIT is read in LINE_LIMIT pieces; iteration numbers past 2**63 are not iterations;
each `launch` list keeps at most DISTINCT_CAP values.
"""

from __future__ import annotations

import argparse
import functools
import json
import marshal
import math
import os
import re
import sqlite3
import sys
from pathlib import Path

# The first iterations pay one-off costs (NCCL communicator and userbuffers set-up, allocator growth, kernel
# autotuning, the first param all-gather), so steady-state numbers skip them.
WARMUP_ITERS = 10
LINE_LIMIT = 8 << 20  # characters; a real log line is < 1 kB, so only a newline-free binary file meets it
DISTINCT_CAP = 32  # launch values kept per kind: one is normal, two already means a mixed log
_BATCH = 4096  # records per SQLite round trip
_MAX_ITER = 2**63  # SQLite's INTEGER key

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
INT_FIELDS = ("consumed_samples", "global_batch_size", "skipped", "nan_iters")
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
# Lower-case words, one of which is in every line an EVENTS pattern matches (test_logparse checks each alternative
# against them). A line with none skips the six searches, which were most of the parse time.
_EVENT_HINTS = (
    "illegal memory",
    "watchdog",
    "out of memory",
    "outofmemory",
    "node fail",
    "node_fail",
    "preempt",
    "time limit",
)
# Where the launch is stated (see the module doc). A usage message names `--recipe RECIPE` too: not a launch.
_LAUNCH = re.compile(
    r"preflight: (?:OK|FAILED) \(\d+/(?P<preflight>\d+) ranks\)"
    r"|using world size: (?P<megatron>\d+)"
    r"|initialized HyperCommGrid with tp=(?P<tp>\d+), pp=(?P<pp>\d+), cp=(?P<cp>\d+), dp=(?P<dp>\d+)"
    r"|launch\.entry\b.*?--recipe[= ](?P<recipe>[\w.\-]+)"
    r"|/experiments/(?P<experiment>[\w.\-]+)/(?P=experiment)_\d+/"
)


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
            if key not in INT_FIELDS:
                rec[key] = val
            elif math.isfinite(val):  # a count printed as nan/inf is no count
                rec[key] = int(val)
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


def parse_launch_line(line: str) -> tuple[str, int | str] | None:
    """("world_sizes" | "recipes", value) when the line states the launch's world size or recipe."""
    m = _LAUNCH.search(line)
    if not m:
        return None
    g = m.groupdict()
    if g["preflight"] or g["megatron"]:
        return "world_sizes", int(g["preflight"] or g["megatron"])
    if g["tp"]:
        return "world_sizes", math.prod(int(g[k]) for k in ("tp", "pp", "cp", "dp"))
    if g["recipe"] and "usage:" in line:
        return None
    return "recipes", g["recipe"] or g["experiment"]


def _may_hold_event(line: str) -> bool:
    low = line.lower()
    return any(h in low for h in _EVENT_HINTS)


# --- the summary, one record at a time -----------------------------------------------------------------------


class _Sum:
    """Python 3.12's sum() of floats (Neumaier-compensated), fed one value at a time, so a streamed mean is
    sum(xs) / len(xs) to the last bit and the JSON is the one a list gave."""

    def __init__(self):
        self.n, self.total, self.comp = 0, 0, 0.0

    def add(self, x: float) -> None:
        if self.n:
            t = self.total + x
            self.comp += (self.total - t) + x if abs(self.total) >= abs(x) else (x - t) + self.total
            self.total = t
        else:
            self.total = 0 + x  # sum() starts from the int 0
        self.n += 1

    def mean(self) -> float | None:
        if not self.n:
            return None
        total = self.total + self.comp if self.comp and math.isfinite(self.comp) else self.total
        return total / self.n


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def warmup_skip(count: int, warmup: int = WARMUP_ITERS) -> int:
    """The leading iterations the summary leaves out of a log of `count`: the warm-up, or with fewer iterations than
    that the first half (the second half is the best steady-state estimate there is)."""
    return warmup if count > warmup else count // 2


class _Summary:
    """The summary, fed the records in iteration order: a streamed log needs no list of them."""

    def __init__(self, count: int, warmup: int, iteration_at, exclude=()):
        self.count, self.skip = count, warmup_skip(count, warmup)
        self.after = iteration_at(self.skip - 1) if self.skip else 0  # steady state: iterations past this one
        self.exclude, self.excluded = frozenset(exclude), []  # iterations a profiler slowed (runopts.NSYS)
        self.first = self.last = self.last_loss = None
        self.times, self.tflops = _Sum(), _Sum()
        self.nan = self.nan_if_losses = self.skipped = self.incomplete = 0
        self.any_loss = False

    def add(self, r: dict) -> dict:
        self.first = r["iteration"] if self.first is None else self.first
        self.last = r
        if r["iteration"] in self.exclude:
            self.excluded.append(r["iteration"])
        elif r["iteration"] > self.after:
            if _finite(r.get("step_time_ms")):
                self.times.add(r["step_time_ms"])
            if _finite(r.get("tflops_per_gpu")):
                self.tflops.add(r["tflops_per_gpu"])
        if has_loss := "lm_loss" in r:
            self.any_loss, self.last_loss = True, r["lm_loss"]
        # Bridge leaves a NaN loss out of the line and counts it in "number of nan iterations"; Megatron-LM builds
        # may print "lm loss: nan". Count both, plus a complete line with no loss at all (the NaN case in Bridge)
        # — that one only where other lines do print a loss, which is known at the end.
        if (
            r.get("nan_iters", 0) > 0
            or (has_loss and not math.isfinite(r["lm_loss"]))
            or ("grad_norm" in r and not math.isfinite(r["grad_norm"]))
        ):
            self.nan += 1
        elif r["complete"] and not has_loss:
            self.nan_if_losses += 1
        self.skipped += r.get("skipped", 0)
        self.incomplete += not r["complete"]
        return r

    def result(self, peak_mem_gb: float | None) -> dict:
        last = self.last or {}
        return {
            "iterations": self.count,
            "first_iteration": self.first,
            "last_iteration": last.get("iteration"),
            "train_iters": last.get("train_iters"),
            "warmup_skipped": self.skip,
            "steady_iterations": self.times.n,
            "excluded_iterations": self.excluded,
            "step_time_ms": self.times.mean(),
            "tflops_per_gpu": self.tflops.mean(),
            "last_loss": self.last_loss,
            "nan_iterations": self.nan + (self.nan_if_losses if self.any_loss else 0),
            "skipped_iterations": self.skipped,
            "incomplete_lines": self.incomplete,
            "peak_mem_gb": peak_mem_gb,
        }


def _peak_with(peak: float | None, mem: dict) -> float | None:
    # Bridge: mem-max-allocated-gigabytes; Megatron-LM: "max allocated" (MB, converted above). max() semantics.
    for k, v in mem["gb"].items():
        if k in ("mem-max-allocated-gigabytes", "max allocated") and (peak is None or v > peak):
            peak = v
    return peak


def summarize(iters: list[dict], memory: list[dict], warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    """`exclude`: iterations left out of the step-time and TFLOP/s means (the ones an Nsight capture slowed)."""
    acc = _Summary(len(iters), warmup, lambda k: iters[k]["iteration"], exclude)
    for r in iters:
        acc.add(r)
    return acc.result(functools.reduce(_peak_with, memory, None))


def profiled_iterations(plan: dict) -> range:
    """The iterations plan.json's NSYS window slowed (plan/runopts.py: perturbed_iterations), to leave out of the
    steady-state means; none for a run that was not profiled."""
    from overlapkit.plan import runopts

    nsys = (plan.get("run") or {}).get("nsys") or {}
    return runopts.perturbed_iterations(tuple(nsys["steps"]) if nsys.get("steps") else None)


# --- the streaming parser ------------------------------------------------------------------------------------


class LogParser:
    """Feed a log line by line (`feed`, `feed_files`); read back in iteration order. Memory stays bounded: see the
    module doc. Use as a context manager (closes the temporary database)."""

    def __init__(self, warmup: int = WARMUP_ITERS, exclude=()):
        if warmup < 0:
            raise ValueError(f"warmup={warmup}: give a number of iterations >= 0")
        self.warmup, self.peak, self.events, self.exclude = warmup, None, {}, tuple(exclude)
        self.facts: dict[str, set] = {"recipes": set(), "world_sizes": set(), "global_batch_sizes": set()}
        self._db = sqlite3.connect("")  # "": private, deleted on close; kept in memory until it grows
        self._db.executescript(
            "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
            "CREATE TABLE it (iteration INTEGER PRIMARY KEY, complete INTEGER, rec BLOB);"
            "CREATE TABLE mem (seq INTEGER PRIMARY KEY, rec BLOB);"
        )
        self._its, self._mems = [], []

    def __enter__(self) -> LogParser:
        return self

    def __exit__(self, *exc) -> None:
        self._db.close()

    def feed(self, line: str, terminated: bool = True) -> None:
        """One line, without its newline; `terminated`: a newline followed it (else the job may have died
        mid-print)."""
        if "iteration" in line and (rec := parse_iteration_line(line)) is not None:
            if rec["iteration"] < _MAX_ITER:
                self._its.append((rec["iteration"], rec["complete"], marshal.dumps(rec)))
                if "global_batch_size" in rec:
                    self._fact("global_batch_sizes", rec["global_batch_size"])
        elif "[Rank " in line and (mem := parse_memory_line(line, terminated)) is not None:
            self._mems.append((marshal.dumps(mem),))
            self.peak = _peak_with(self.peak, mem)
        elif fact := parse_launch_line(line):
            self._fact(*fact)
        if len(self.events) < len(EVENTS) and _may_hold_event(line):
            for name, rx in EVENTS.items():
                if name not in self.events and rx.search(line):
                    self.events[name] = line.strip()[:300]
        if len(self._its) + len(self._mems) >= _BATCH:
            self._flush()

    def feed_files(self, paths) -> None:
        """Several logs of one job (nemo_run writes one per task group) read as one text: each file but the last
        ends in a newline."""
        paths = list(paths)
        for i, path in enumerate(paths):
            last = i == len(paths) - 1
            with open(path, encoding="utf-8", errors="replace") as f:
                for raw in iter(functools.partial(f.readline, LINE_LIMIT), ""):
                    whole = raw.endswith("\n")
                    self.feed(raw[:-1] if whole else raw, whole or not last)

    def _fact(self, kind: str, value) -> None:
        if len(self.facts[kind]) < DISTINCT_CAP:
            self.facts[kind].add(value)

    def _flush(self) -> None:
        # The last occurrence of an iteration wins, but a complete line is never replaced by a torn one.
        self._db.executemany(
            "INSERT INTO it VALUES (?, ?, ?) ON CONFLICT(iteration) DO UPDATE SET complete = excluded.complete,"
            " rec = excluded.rec WHERE excluded.complete OR NOT it.complete",
            self._its,
        )
        self._db.executemany("INSERT INTO mem (rec) VALUES (?)", self._mems)
        self._its, self._mems = [], []

    def iterations(self):
        self._flush()
        return (marshal.loads(b) for (b,) in self._db.execute("SELECT rec FROM it ORDER BY iteration"))

    def memory(self):
        self._flush()
        return (marshal.loads(b) for (b,) in self._db.execute("SELECT rec FROM mem ORDER BY seq"))

    def launch(self) -> dict:
        return {k: sorted(v) for k, v in self.facts.items()}

    def count(self) -> int:
        """Distinct iterations so far."""
        self._flush()
        return self._db.execute("SELECT COUNT(*) FROM it").fetchone()[0]

    def summary_builder(self) -> _Summary:
        count = self.count()
        at = "SELECT iteration FROM it ORDER BY iteration LIMIT 1 OFFSET ?"
        return _Summary(count, self.warmup, lambda k: self._db.execute(at, (k,)).fetchone()[0], self.exclude)

    def result(self) -> dict:
        """The whole parse as one dict (every record in memory)."""
        iters, memory = list(self.iterations()), list(self.memory())
        return {
            "iterations": iters,
            "memory": memory,
            "events": dict(self.events),
            "summary": summarize(iters, memory, self.warmup, self.exclude),
            "launch": self.launch(),
        }


def parse_text(text: str, warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    with LogParser(warmup, exclude) as p:
        lines = text.split("\n")  # "\n" only, as always: a "\r" stays part of its line here
        for i, line in enumerate(lines):
            p.feed(line, i < len(lines) - 1)  # the final piece has no newline: the job may have died mid-print
        return p.result()


def parse_file(path: Path | str, warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    return parse_files([path], warmup, exclude)


def parse_files(paths, warmup: int = WARMUP_ITERS, exclude=()) -> dict:
    """Several logs of one job (nemo_run writes one per task group): parsed as one text; `exclude` as summarize."""
    with LogParser(warmup, exclude) as p:
        p.feed_files(paths)
        return p.result()


# --- JSON ----------------------------------------------------------------------------------------------------


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


def _dump_at(value, level: int) -> str:
    """to_json(value) as it reads `level` deep inside a larger document (json's indent is per level)."""
    return to_json(value).replace("\n", "\n" + "  " * level)


# An iteration record is a flat dict: json's C encoder (it runs only without indent) writes it with the indented
# layout's separators, several times faster than the pure-Python indenting encoder; allow_nan=False sends a record
# holding NaN/inf to _clean first.
_RECORD_LEVEL = 2  # {"iterations": [ {record} ]}
_RECORD_PAD = "\n" + "  " * (_RECORD_LEVEL + 1)
_RECORD = json.JSONEncoder(separators=("," + _RECORD_PAD, ": "), allow_nan=False)


def _dump_record(rec: dict, level: int) -> str:
    """_dump_at(rec, level) for a flat, non-empty dict at _RECORD_LEVEL."""
    assert level == _RECORD_LEVEL and rec
    try:
        text = _RECORD.encode(rec)
    except ValueError:
        text = _RECORD.encode(_clean(rec))
    return "{" + _RECORD_PAD + text[1:-1] + "\n" + "  " * level + "}"


def _write_list(out, items, level: int, dump=_dump_at) -> None:
    sep = "[\n"
    for item in items:
        out.write(sep + "  " * (level + 1) + dump(item, level + 1))
        sep = ",\n"
    out.write("[]" if sep == "[\n" else "\n" + "  " * level + "]")


def write_json(p: LogParser, out) -> None:
    """to_json(p.result()), written piece by piece: the records stream from the database, the summary is built on
    the way."""
    acc = p.summary_builder()
    out.write('{\n  "iterations": ')
    _write_list(out, (acc.add(r) for r in p.iterations()), 1, _dump_record)
    out.write(',\n  "memory": ')
    _write_list(out, p.memory(), 1)
    out.write(f',\n  "events": {_dump_at(p.events, 1)},\n  "summary": {_dump_at(acc.result(p.peak), 1)}')
    out.write(f',\n  "launch": {_dump_at(p.launch(), 1)}\n}}')


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of iterations >= 0")
    return int(text)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every bad input (argparse prints its usage block first)
        print(f"error: {message} (give LOG=<path to a training log>)", file=sys.stderr)
        sys.exit(2)


_SNIFF = 64 << 10  # bytes read to tell a binary file (a NUL byte: no training log prints one) from a log


def _args(argv):
    ap = _Parser(prog="make parse-log", description="Bridge training log → JSON")
    ap.add_argument("log", nargs="?", default=None, help="the log (or --log=PATH, for a path starting with -)")
    ap.add_argument("--log", dest="log_option", default=None)
    ap.add_argument("--warmup", type=_count, default=WARMUP_ITERS)
    args = ap.parse_args(argv)
    given = args.log_option if args.log_option is not None else args.log
    if not given:
        ap.error("LOG= is empty")
    return Path(given), args.warmup


def _not_a_log(log: Path) -> str | None:
    """Why `log` cannot be a training log before it is read through (missing, a directory, binary), or None."""
    if not log.is_file():
        return "not a file" if log.exists() else "no such file"
    with log.open("rb") as f:
        if b"\0" in f.read(_SNIFF):
            return "binary (NUL bytes), not a training log"
    return None


def _no_iterations(log: Path, p: LogParser) -> str:
    said = f"; it reports {', '.join(sorted(p.events))} before any iteration" if p.events else ""
    return (
        f"error: LOG={log}: no training iterations found (Megatron Bridge/Megatron-LM print one line per log interval"
        f", ' iteration   10/  100 | consumed samples: ... |'){said}: give a training job's log (make logs RUN=...)"
    )


def main(argv=None) -> int:
    log, warmup = _args(argv)
    try:
        if why := _not_a_log(log):
            print(f"error: LOG={log}: {why} (give LOG=<path to a training log>)", file=sys.stderr)
            return 2
        with LogParser(warmup) as p:
            p.feed_files([log])
            if not p.count():
                print(_no_iterations(log, p), file=sys.stderr)
                return 1
            write_json(p, sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
    except BrokenPipeError:  # `make parse-log ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        print(f"error: LOG={log}: {exc.strerror or exc} (give LOG=<a readable training log>)", file=sys.stderr)
        return 2
    except sqlite3.Error as exc:
        print(f"error: parse-log's temporary store: {exc} (free space in $TMPDIR, or set TMPDIR)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
