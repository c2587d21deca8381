"""The run options, typed: RUN_NAME (checkpoints and logs that outlive the job), SEGMENTS (a run longer than the
time limit, as chained jobs), NSYS (an Nsight Systems window), TORCH_PROFILE (a PyTorch-profiler window, for clusters
without Nsight Systems) and DATA (bridge/data.py); parsed before the Bridge import (one line per bad value), with the
file names a profiled run leaves and Slurm's time formats. bridge/runopts.py applies them to Bridge's config and
audits them there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.names import checked_name

MAX_SEGMENTS = 100
# The largest integer a config field or an iteration count can hold: Megatron and torch keep them as int64 (a value
# beyond it overflows in the first tensor or numpy array made from it): jsonio's, for the NSYS window below and every
# SET value (overrides.number_problem).
INT64_MAX = jsonio.INT64[1]
# Seconds before the time limit at which Slurm sends SIGTERM: Bridge's handler saves a checkpoint at the end of the
# current iteration and exits. Five minutes covers one step plus a distributed save of a 405B model on a parallel
# filesystem; Bridge's own default (60 s) is too short for that.
PREEMPT_S = 300
# exit_duration_in_mins stops training (with a save) this long before the limit: the second guard when a signal is
# lost (srun not forwarding it, a data-loader hang at that moment). It must fire before the signal would.
GUARD_MIN = 15


@dataclass(frozen=True)
class RunOptions:
    run_name: str = ""
    segments: int = 1
    nsys: tuple[int, int] | None = None  # profile_step_start, profile_step_end
    nsys_ranks: tuple[int, ...] = (0,)
    torch_profile: tuple[int, int] | None = None  # the PyTorch profiler's window: profile_step_start, _end
    torch_profile_ranks: tuple[int, ...] = (0,)
    data: dict | None = None  # plan.data.DataSpec.to_dict(), re-checked where it is applied
    job_dir: str = ""  # the profile's shared job directory (checkpoints live under it)
    time_limit_min: int | None = None  # per segment
    wandb: dict | None = None  # {"project", "entity"} from the profile

    @property
    def checkpoint_dir(self) -> str | None:
        return str(Path(self.job_dir) / "checkpoints" / self.run_name) if self.run_name and self.job_dir else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> RunOptions:
        d = dict(d or {})
        for key in PROFILERS:  # JSON's lists, the tuples again
            d[key] = tuple(d[key]) if d.get(key) else d.get(key)
            d[f"{key}_ranks"] = tuple(d.get(f"{key}_ranks") or (0,))
        return cls(**d)

    @property
    def window(self) -> tuple[str, tuple[int, int], tuple[int, ...]] | None:
        """The profiled window, whichever profiler: (knob name, (start, end), ranks), or None."""
        if self.nsys:
            return "NSYS", self.nsys, self.nsys_ranks
        if self.torch_profile:
            return "TORCH_PROFILE", self.torch_profile, self.torch_profile_ranks
        return None


def whole(text: str) -> int | None:
    """`text` (a make variable: NODES, SEGMENTS, a profiler's window and ranks, LAYERS=...) as a whole number
    written in ASCII digits within int64, else None: jsonio.integer's one rule, the sign refused (str.isdigit also
    takes '²', which int() refuses with a traceback, and the full-width '８', which int() reads as 8; 5,000 digits
    would reach Python's digit limit: none of them is something a user meant to type)."""
    t = (text or "").strip()
    return jsonio.integer(t) if t[:1] != "-" else None


# A yes/no make variable (DRYRUN=, FORCE=): these words, any case, empty off; nothing guessed (FORCE=off once
# overwrote data.toml).
ON, OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def switch(text: str) -> bool:
    """An argparse `type=`: a yes/no value as ON or OFF say, else argparse's one-line error naming the option."""
    word = text.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF[1:])}, or empty)"
    )


def parse_window(text: str, ranks: str, knob: str) -> tuple[tuple[int, int] | None, tuple[int, ...]]:
    """A profiler's window `<start>:<end>` and its ranks, as typed for `knob` (NSYS or TORCH_PROFILE)."""
    t = (text or "").strip()
    if not t:
        if (ranks or "").strip():
            raise BadInput(f"{knob}_RANKS= without {knob}=<start>:<end>: give the profiled steps too")
        return None, (0,)
    m = re.fullmatch(r"(\d+):(\d+)", t, re.ASCII)
    start, end = (whole(m.group(1)), whole(m.group(2))) if m else (None, None)
    if m and None in (start, end):
        raise BadInput(f"{knob}={text!r}: iterations are at most {INT64_MAX:,} (and within train.train_iters)")
    if not m or start >= end:
        raise BadInput(f"{knob}={text!r}: use <start>:<end> iterations with start < end, e.g. {knob}=10:12")
    parts = [whole(p) for p in (ranks or "0").split(",")]
    if None in parts:
        raise BadInput(
            f"{knob}_RANKS={ranks!r}: comma-separated global ranks (whole numbers below the run's world size), "
            f"e.g. {knob}_RANKS=0,8"
        )
    return (start, end), tuple(sorted(set(parts)))


def nsys_problem(opts: RunOptions, train_iters: int | None, world: int) -> str | None:
    """The profiler's window (NSYS or TORCH_PROFILE) against the built run: its steps within train.train_iters
    (Bridge's profiler never starts past the last step, so the job would end with no profile), its ranks within the
    world size."""
    if (window := opts.window) is None:
        return None
    knob, (a, b), ranks = window
    if train_iters is not None and b > train_iters:
        end = f"use an end ≤ {train_iters}"
        return f"{knob}={a}:{b}: the run ends at iteration {train_iters} (train.train_iters): {end}"
    if beyond := [r for r in ranks if r >= world]:
        text = ",".join(map(str, ranks))
        return f"{knob}_RANKS={text}: rank {beyond[0]} is beyond the run's {world} ranks: use ranks 0..{world - 1}"
    return None


# What a NSYS run leaves in its run directory, under one set of names: each profiled rank's report and SQLite export
# in nsys/ (profile/profiled.py writes them in the job), and their overlap report with its timeline picture, which
# `make overlap-report RUN=` writes (launch/overlap_report.py), the job's first profiled rank writes too, and the
# nightly reads and links (nightly/night_report.py). Here, below every stage that names them (the sbatch script too).
NSYS_DIR, OVERLAP_JSON, OVERLAP_PNG = "nsys", "overlap_report.json", "overlap_timeline.png"
# What a rank NSYS profiles needs (the preflight's check, and profile/profiled.py's error when it wraps the rank).
NSYS_FIX = "run in a container image with Nsight Systems (the NeMo container has it) or add its bin/ to PATH"
# What the job rebuilds the recipe from (bridge/build.py writes it): the SET pairs exactly as typed (JSON keeps spaces,
# lists and dicts intact; a command line would split them) and the bound run options. launch/entry.py reads it
# (bridge/request.py from_record); plugins add to its command line.
OVERRIDES = "overrides.json"
# The PyTorch profiler's traces of a TORCH_PROFILE run, one rank-<R>.json.gz per profiled rank (Bridge's own file
# name, training/profiling.py), copied there in the job (profile/profiled.py).
TORCH_DIR = "torch_profile"
# The two profilers a run can use, by the plan's key (plan.json run.<key>, a night's entry, a cluster profile's
# `profiler`): the make variable that sets its window, and the run directory's folder of its per-rank profiles.
PROFILERS = {"nsys": ("NSYS", NSYS_DIR), "torch_profile": ("TORCH_PROFILE", TORCH_DIR)}


def planned_window(run: dict | None) -> tuple[str, dict] | None:
    """A plan's profiled window, whichever profiler: (its key in PROFILERS, {"steps": [start, end], "ranks": [...]}),
    or None for a run that profiles nothing."""
    return next(((key, run[key]) for key in PROFILERS if (run or {}).get(key)), None)


def perturbed_iterations(window: tuple[int, int] | None, profiler: str = "nsys") -> range:
    """The logged iterations whose step time the profiler's window <start>:<end> changes (iteration i is logged with
    train_state.step == i after the step; Bridge 0.6.2 training/train.py with training/profiling.py).

    nsys: cudaProfilerStart at the top of the loop while train_state.step == start (the step then logged as iteration
    start+1) and cudaProfilerStop after the log of iteration `end`, so the capture holds iterations start+1..end; the
    stop's flush falls in the interval timer of iteration end+1, which is perturbed too.

    torch_profile: torch.profiler.schedule(wait=start-1, warmup=1, active=end-start) advanced by prof.step() at the top
    of every iteration, so iteration i runs at the profiler's step i: start-1 is its warm-up (tracing on, kept from the
    trace), start..end-1 are recorded (ProfilerStep#start..#end-1), and the step() at the top of iteration `end`
    stops the trace and exports it (Bridge's trace_handler writes the .json.gz) inside that iteration's timer."""
    if not window:
        return range(0)
    if profiler == "torch_profile":
        return range(max(window[0] - 1, 1), window[1] + 1)
    return range(window[0] + 1, window[1] + 2)


def same_capture(window: tuple[int, int], profiler: str) -> tuple[int, int]:
    """The window for `profiler` that captures the iterations an nsys window `window` captures (nsys start:end holds
    start+1..end; the PyTorch profiler's start:end holds start..end-1): NSYS=33:35 and TORCH_PROFILE=34:36 both
    capture iterations 34 and 35."""
    return (window[0] + 1, window[1] + 1) if profiler == "torch_profile" else window


def parse(run_name="", segments="", nsys="", nsys_ranks="", torch_profile="", torch_profile_ranks="") -> RunOptions:
    """Everything typed but DATA (bridge/request.py reads its data.toml after these), checked before the Bridge
    import, in the order a later check needs an earlier one: RUN_NAME, SEGMENTS (more than one needs RUN_NAME), NSYS
    with NSYS_RANKS, TORCH_PROFILE with its ranks (one profiler per run)."""
    name = (run_name or "").strip()
    if name:  # it names the run's checkpoint, TensorBoard and W&B directories
        checked_name(name, "RUN_NAME", "it names a directory")
    seg = whole(segments) if (segments or "").strip() else 1
    if seg is None or not 1 <= seg <= MAX_SEGMENTS:
        raise BadInput(f"SEGMENTS={segments!r}: a whole number of chained jobs from 1 to {MAX_SEGMENTS}")
    if seg > 1 and not name:
        raise BadInput(f"SEGMENTS={segments.strip()} needs RUN_NAME=<name>: later segments resume from its checkpoints")
    window, ranks = parse_window(nsys, nsys_ranks, "NSYS")
    torch_window, torch_ranks = parse_window(torch_profile, torch_profile_ranks, "TORCH_PROFILE")
    if window and torch_window:  # Bridge's ProfilingConfig.finalize asserts the same
        raise BadInput("NSYS= and TORCH_PROFILE= together: one profiler per run (Bridge runs one); drop one")
    return RunOptions(
        run_name=name,
        segments=seg,
        nsys=window,
        nsys_ranks=ranks,
        torch_profile=torch_window,
        torch_profile_ranks=torch_ranks,
    )


def minutes(limit: str) -> int | None:
    """Slurm's time formats (sbatch --time, sinfo %l) in minutes; None for infinite/unlimited."""
    text = limit.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, s = (parts + [0, 0])[:3]
    else:  # MM, MM:SS, HH:MM:SS
        h, m, s = (0, parts[0], 0) if len(parts) == 1 else ([0] * (3 - len(parts)) + parts)
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def directory_problem(path: str) -> str | None:
    """Why `path` cannot be a checkpoint directory (a file, a link loop, unreadable), or None (a directory, or
    nothing there yet). The audit's rule, and the job's resume guard's (cluster/resume.py)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link loop; ENOTDIR: a file on the way; EACCES
        return f"{path} cannot be used as a directory ({exc.strerror})"
    return None if stat.S_ISDIR(st.st_mode) else f"{path} is a file, not a directory"
