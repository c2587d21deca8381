"""What makes a benchmark a pretraining run: RUN_NAME (checkpoints and logs that outlive the job), SEGMENTS (a run
longer than the time limit, as chained jobs), NSYS (an Nsight Systems window), TORCH_PROFILE (a PyTorch-profiler
window, for clusters without Nsight Systems) and DATA (bridge/data.py).

Parsed before the Bridge import (one line per bad value), applied to the built config by `apply`, in the plan and
again in the job (the options travel in the run directory's overrides.json), and audited by `findings`:

- RUN_NAME=<name>: checkpoints save to and load from `<job_dir>/checkpoints/<name>`, TensorBoard in
  `<job_dir>/tensorboard/<name>`, W&B project/entity from the profile with the run name (the key by name only, in the
  profile's secrets). Without it the run is a benchmark: no checkpoints (Bridge's default,
  `$CWD/nemo_experiments/default`, is inside a job's packaged code directory and lost with it).
- SEGMENTS=<N>: each segment is sent SIGTERM before its time limit (Bridge's PreemptionPlugin: `--signal=TERM@<s>`)
  with `train.exit_signal_handler` on, and `train.exit_duration_in_mins` as the second guard.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
# What Bridge's PreemptionPlugin appends to the job's arguments for a RUN_NAME run (megatron/bridge/recipes/
# run_plugins.py, _default_preemption_converter: PreemptionPluginScriptArgs' defaults), after the user's SET: the job
# runs these whatever SET says, so `apply` puts them in the plan and the audit refuses a SET that says otherwise.
PREEMPTION_TRAIN = {"exit_signal_handler": True, "exit_signal_handler_for_dataloader": False}


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
        if d.get("nsys"):
            d["nsys"] = tuple(d["nsys"])
        d["nsys_ranks"] = tuple(d.get("nsys_ranks") or (0,))
        if d.get("torch_profile"):
            d["torch_profile"] = tuple(d["torch_profile"])
        d["torch_profile_ranks"] = tuple(d.get("torch_profile_ranks") or (0,))
        return cls(**d)

    @property
    def window(self) -> tuple[str, tuple[int, int], tuple[int, ...]] | None:
        """The profiled window, whichever profiler: (knob name, (start, end), ranks), or None."""
        if self.nsys:
            return "NSYS", self.nsys, self.nsys_ranks
        if self.torch_profile:
            return "TORCH_PROFILE", self.torch_profile, self.torch_profile_ranks
        return None

    def data_spec(self):
        """The DataSpec, re-read from its data.toml (in the job too: the files must be on the shared filesystem)."""
        from overlapkit.bridge import data as data_spec

        return data_spec.load(self.data["source"]) if self.data else None


def whole(text: str) -> int | None:
    """`text` (a make variable: NODES, SEGMENTS, a profiler's window and ranks, LAYERS=...) as a whole number
    written in ASCII digits within int64, else None: jsonio.integer's one rule, the sign refused (str.isdigit also
    takes '²', which int() refuses with a traceback, and the full-width '８', which int() reads as 8; 5,000 digits
    would reach Python's digit limit: none of them is something a user meant to type)."""
    t = (text or "").strip()
    return jsonio.integer(t) if t[:1] != "-" else None


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
# The PyTorch profiler's traces of a TORCH_PROFILE run, one rank-<R>.json.gz per profiled rank (Bridge's own file
# name, training/profiling.py), copied there in the job (profile/profiled.py).
TORCH_DIR = "torch_profile"
# The two profilers a run can use, by the plan's key (plan.json run.<key>, a night's entry, a cluster profile's
# `profiler`): the make variable that sets its window, and the run directory's folder of its per-rank profiles.
PROFILERS = {"nsys": ("NSYS", NSYS_DIR), "torch_profile": ("TORCH_PROFILE", TORCH_DIR)}


def planned_window(run: dict | None) -> tuple[str, dict] | None:
    """A plan's profiled window, whichever profiler: (its key in PROFILERS, {"steps": [start, end], "ranks": [...]}),
    or None for a run that profiles nothing."""
    for key in PROFILERS:
        if (run or {}).get(key):
            return key, run[key]
    return None


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


def parse(
    run_name="", segments="", nsys="", nsys_ranks="", data="", torch_profile="", torch_profile_ranks=""
) -> RunOptions:
    """Everything typed, checked before the Bridge import (DATA's files and headers too), in the order a later
    check needs an earlier one: RUN_NAME, SEGMENTS (more than one needs RUN_NAME), NSYS with NSYS_RANKS,
    TORCH_PROFILE with its ranks (one profiler per run), DATA."""
    from overlapkit.bridge import data as data_spec

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
    spec = data_spec.load(data).to_dict() if (data or "").strip() else None
    return RunOptions(
        run_name=name,
        segments=seg,
        nsys=window,
        nsys_ranks=ranks,
        torch_profile=torch_window,
        torch_profile_ranks=torch_ranks,
        data=spec,
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


def apply(cfg, opts: RunOptions) -> None:
    """Bind the config to the run: checkpoints, logs, the exit guards, the Nsight window, the data. Called before
    the user's SET, so an explicit SET still wins (and is audited)."""
    from overlapkit.bridge import data as data_spec

    where = opts.checkpoint_dir  # None: a benchmark saves nothing (see the module docstring)
    cfg.checkpoint.save = cfg.checkpoint.load = where
    if where:
        cfg.logger.tensorboard_dir = str(Path(opts.job_dir) / "tensorboard" / opts.run_name)
        if opts.wandb:
            cfg.logger.wandb_project, cfg.logger.wandb_entity = opts.wandb["project"], opts.wandb.get("entity")
            cfg.logger.wandb_exp_name = opts.run_name
            cfg.logger.wandb_save_dir = str(Path(opts.job_dir) / "wandb" / opts.run_name)
        for field, value in PREEMPTION_TRAIN.items():
            setattr(cfg.train, field, value)
        if opts.time_limit_min:
            cfg.train.exit_duration_in_mins = opts.time_limit_min - GUARD_MIN
    if opts.nsys:
        from megatron.bridge.training.config import ProfilingConfig

        cfg.profiling = ProfilingConfig(
            use_nsys_profiler=True,
            profile_step_start=opts.nsys[0],
            profile_step_end=opts.nsys[1],
            profile_ranks=list(opts.nsys_ranks),
        )
    if opts.torch_profile:  # Bridge writes <tensorboard_dir>/../torch_profile/rank-<R>.json.gz (profiled.py copies it)
        from megatron.bridge.training.config import ProfilingConfig

        cfg.profiling = ProfilingConfig(
            use_pytorch_profiler=True,
            profile_step_start=opts.torch_profile[0],
            profile_step_end=opts.torch_profile[1],
            profile_ranks=list(opts.torch_profile_ranks),
        )
    if spec := opts.data_spec():
        data_spec.apply(cfg, spec)


def findings(cfg, opts: RunOptions, profile, world: int) -> list[tuple[str, str, str]]:
    """The run options against the built run of `world` ranks. A profiler window it cannot honour stops the plan
    (BadInput); the rest is (level, code, message): the run's checkpoint settings, then its W&B logging (the key
    must come from the profile's secrets), its data (epochs of the train split the run reads), and a SET that
    PREEMPTION_TRAIN overrides in the job (refused, so what plan.json records is what runs)."""
    from overlapkit.bridge import data as data_spec

    if msg := nsys_problem(opts, cfg.train.train_iters, world):
        raise BadInput(msg)
    out = _checkpoint_findings(cfg.checkpoint, opts)
    if opts.wandb and "WANDB_API_KEY" not in getattr(profile, "secrets", ()):
        out.append(
            (
                "error",
                "wandb_key_not_secret",
                f"W&B project {opts.wandb['project']} set in the profile but "
                'WANDB_API_KEY is not in its secrets: add secrets = ["WANDB_API_KEY"]',
            )
        )
    if opts.data and (eps := data_spec.consumption(cfg, opts.data_spec()).get("epochs")) and eps > 1:
        out.append(
            (
                "warning",
                "data_epochs",
                f"the run reads {eps:.2f} epochs of the train split: more data, or "
                "fewer train.train_iters, if repeating it is not intended",
            )
        )
    if opts.checkpoint_dir:
        out += [
            (
                "error",
                "set_overridden_by_preemption",
                f"train.{field}={getattr(cfg.train, field)} (SET): with RUN_NAME the job runs train.{field}={value} "
                "(Bridge's PreemptionPlugin appends it after SET, to save a checkpoint on the time limit's SIGTERM); "
                f"drop train.{field} from SET, or leave RUN_NAME empty",
            )
            for field, value in PREEMPTION_TRAIN.items()
            if getattr(cfg.train, field) != value
        ]
    return out


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


def _checkpoint_findings(ck, opts: RunOptions) -> list[tuple[str, str, str]]:
    """Where checkpoints go, whether segments can resume from them, how they are saved and how often."""
    if ck.save and (problem := directory_problem(ck.save)):
        fix = "move it away, or use another RUN_NAME"
        return [("error", "checkpoint_not_a_directory", f"checkpoint.save: {problem}: {fix}")]
    out = []
    if opts.job_dir and ck.save and not Path(ck.save).resolve().is_relative_to(Path(opts.job_dir).resolve()):
        out.append(
            (
                "error",
                "checkpoint_outside_job_dir",
                f"checkpoint.save={ck.save} is outside the profile's "
                f"shared job_dir {opts.job_dir}: it would be lost with the job; use RUN_NAME=<name>",
            )
        )
    if opts.segments > 1 and not (ck.save and ck.load == ck.save):
        out.append(
            (
                "error",
                "segments_without_checkpoints",
                "SEGMENTS>1 needs checkpoint.save = checkpoint.load "
                "(RUN_NAME sets both): a later segment would start from iteration 0",
            )
        )
    if (
        ck.save
        and ck.async_save
        and ck.async_strategy == "nvrx"
        and not importlib.util.find_spec("nvidia_resiliency_ext")
    ):
        out.append(
            (
                "warning",
                "async_save_needs_nvrx",
                "checkpoint.async_save with async_strategy=nvrx needs "
                "nvidia-resiliency-ext, not importable here (the NeMo container ships it; Bridge falls back to "
                "mcore without it): SET checkpoint.async_strategy=mcore to be explicit",
            )
        )
    if ck.save and not ck.save_interval:
        out.append(
            (
                "warning",
                "no_save_interval",
                "checkpoint.save_interval is null: only the exit save; a crash "
                "loses the whole segment (SET checkpoint.save_interval=<iterations>)",
            )
        )
    return out


def summary(plan, opts: RunOptions) -> dict:
    """The plan's `run` key: checkpoint directory, save interval and what a crash can lose, segments, Nsight."""
    cfg, ck = plan.cfg, plan.cfg.checkpoint
    # The expected step time is the plan's throughput prediction (sizing/throughput.py), its one home.
    step_s = plan.throughput.step_s if getattr(plan, "throughput", None) is not None else None
    loss_min = round(step_s * ck.save_interval / 60, 1) if step_s and ck.save and ck.save_interval else None
    return {
        "run_name": opts.run_name or None,
        "checkpoint_dir": ck.save,
        "save_interval": ck.save_interval if ck.save else None,
        "expected_step_s": round(step_s, 2) if step_s else None,
        "crash_loss_min": loss_min,
        "tensorboard_dir": cfg.logger.tensorboard_dir if ck.save else None,
        "wandb": opts.wandb,
        "train_iters": cfg.train.train_iters,
        "segments": opts.segments,
        "signal": f"TERM@{PREEMPT_S}" if opts.run_name else None,
        "exit_duration_in_mins": cfg.train.exit_duration_in_mins,
        "exit_signal_handler": cfg.train.exit_signal_handler,
        # what a resume reads (cluster/resume.py): the format's complete files, a chosen iteration, the opt-in
        "ckpt_format": ck.ckpt_format,
        "ckpt_step": ck.ckpt_step,
        "load_optim": ck.load_optim,
        "finetune": ck.finetune,
        "nsys": {"steps": list(opts.nsys), "ranks": list(opts.nsys_ranks)} if opts.nsys else None,
        "torch_profile": {"steps": list(opts.torch_profile), "ranks": list(opts.torch_profile_ranks)}
        if opts.torch_profile
        else None,
    }


def lines(d: dict) -> list[str]:
    """The plan's data / checkpoint / segment lines (plain text; report.render_plan prints them)."""
    data, run = d.get("data") or {"mock": True}, d.get("run") or {}
    n = 0 if data["mock"] else len(data["blend"] or [p for ps in data["blend_per_split"].values() for p in ps])
    out = (
        ["data: mock (benchmark)"]
        if data["mock"]
        else [
            f"data: {n} dataset prefix{'es' if n != 1 else ''}, "
            f"{data['tokens']:,} tokens ({data['train_tokens']:,} in the train split); the run reads "
            f"{data['consumed_tokens']:,} = {data['epochs']} epochs; tokenizer {data['tokenizer']}"
        ]
    )
    for p in data.get("blend") or []:
        out.append(f"  {p['path']}  weight {p['weight']:g}  {p['tokens']:,} tokens {p['dtype']}")
    for split, ps in (data.get("blend_per_split") or {}).items():
        out += [f"  {split}: {p['path']}  weight {p['weight']:g}  {p['tokens']:,} tokens {p['dtype']}" for p in ps]
    if run.get("nsys"):
        out.append(f"nsys: steps {run['nsys']['steps'][0]}-{run['nsys']['steps'][1]} on ranks {run['nsys']['ranks']}")
    if tp := run.get("torch_profile"):
        out.append(
            f"PyTorch profiler: steps {tp['steps'][0]}-{tp['steps'][1]} on ranks {tp['ranks']}; the job keeps the "
            "traces in the run directory's torch_profile/"
        )
    if not run.get("checkpoint_dir"):
        out.append("checkpoints: off (benchmark); RUN_NAME=<name> saves to <job_dir>/checkpoints/<name> and resumes")
        return out
    gpu_h = run["crash_loss_min"] * d["layout"]["gpus"] / 60 if run["crash_loss_min"] else 0
    loss = (
        f" ≈ {run['crash_loss_min']} min ({gpu_h:,.0f} GPU-hours) at the predicted step time {run['expected_step_s']} s"
        if gpu_h
        else " (no step-time prediction for this plan)"
    )
    out.append(
        f"checkpoints: {run['checkpoint_dir']} every {run['save_interval']} iterations; a crash loses up to "
        f"{run['save_interval']} iterations{loss}"
    )
    out.append(
        f"tensorboard: {run['tensorboard_dir']}" + (f"; W&B project {run['wandb']['project']}" if run["wandb"] else "")
    )
    if run["exit_duration_in_mins"]:
        out.append(
            f"segments: {run['segments']} chained job(s) (afterany), SIGTERM {PREEMPT_S} s before each limit "
            f"({run['signal']}), exit_duration_in_mins {run['exit_duration_in_mins']}"
        )
    return out
