"""The run options (RUN_NAME, SEGMENTS, NSYS, TORCH_PROFILE, DATA: typed and parsed before the Bridge import in
spec/runopts.py) applied to the built config by `apply`, in the plan and again in the job (they travel in the run
directory's overrides.json), and audited by `findings`.

Without RUN_NAME the run is a benchmark and saves no checkpoints: Bridge's default, `$CWD/nemo_experiments/default`,
is inside a job's packaged code directory and lost with it. With SEGMENTS, each segment is sent SIGTERM before its
time limit (Bridge's PreemptionPlugin), with `train.exit_duration_in_mins` as the second guard.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from overlapkit.errors import BadInput
from overlapkit.spec.findings import Finding
from overlapkit.spec.runopts import GUARD_MIN, PREEMPT_S, RunOptions, directory_problem, nsys_problem

# What Bridge's PreemptionPlugin appends to the job's arguments for a RUN_NAME run (megatron/bridge/recipes/
# run_plugins.py, _default_preemption_converter: PreemptionPluginScriptArgs' defaults), after the user's SET: the job
# runs these whatever SET says, so `apply` puts them in the plan and the audit refuses a SET that says otherwise.
PREEMPTION_TRAIN = {"exit_signal_handler": True, "exit_signal_handler_for_dataloader": False}


def data_spec(opts: RunOptions):
    """The DataSpec, re-read from its data.toml (in the job too: the files must be on the shared filesystem)."""
    from overlapkit.bridge import data

    return data.load(opts.data["source"]) if opts.data else None


def apply(cfg, opts: RunOptions) -> None:
    """Bind the config to the run: checkpoints, logs, the exit guards, the Nsight window, the data. Called before
    the user's SET, so an explicit SET still wins (and is audited)."""
    from overlapkit.bridge import data

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
    if window := opts.window:  # TORCH_PROFILE: Bridge writes <tensorboard_dir>/../torch_profile/rank-<R>.json.gz
        from megatron.bridge.training.config import ProfilingConfig

        knob, (start, end), ranks = window
        cfg.profiling = ProfilingConfig(
            use_nsys_profiler=knob == "NSYS",
            use_pytorch_profiler=knob == "TORCH_PROFILE",
            profile_step_start=start,
            profile_step_end=end,
            profile_ranks=list(ranks),
        )
    if spec := data_spec(opts):
        data.apply(cfg, spec)


def findings(cfg, opts: RunOptions, profile, world: int) -> list[Finding]:
    """The run options against the built run of `world` ranks. A profiler window it cannot honour stops the plan
    (BadInput); the rest are findings: the run's checkpoint settings, then its W&B logging (the key must come from
    the profile's secrets), its data (epochs of the train split the run reads), and a SET that PREEMPTION_TRAIN
    overrides in the job (refused, so what plan.json records is what runs)."""
    from overlapkit.bridge import data

    if msg := nsys_problem(opts, cfg.train.train_iters, world):
        raise BadInput(msg)
    out = _checkpoint_findings(cfg.checkpoint, opts)
    if opts.wandb and "WANDB_API_KEY" not in getattr(profile, "secrets", ()):
        msg = f"W&B project {opts.wandb['project']} set in the profile but WANDB_API_KEY is not in its secrets"
        out.append(Finding("error", "wandb_key_not_secret", f'{msg}: add secrets = ["WANDB_API_KEY"]'))
    if opts.data and (eps := data.consumption(cfg, data_spec(opts)).get("epochs")) and eps > 1:
        msg = f"the run reads {eps:.2f} epochs of the train split: more data, or fewer train.train_iters"
        out.append(Finding("warning", "data_epochs", f"{msg}, if repeating it is not intended"))
    for field, value in PREEMPTION_TRAIN.items() if opts.checkpoint_dir else ():
        if getattr(cfg.train, field) != value:
            msg = (
                f"train.{field}={getattr(cfg.train, field)} (SET): with RUN_NAME the job runs train.{field}={value} "
                "(Bridge's PreemptionPlugin appends it after SET, to save a checkpoint on the time limit's SIGTERM); "
                f"drop train.{field} from SET, or leave RUN_NAME empty"
            )
            out.append(Finding("error", "set_overridden_by_preemption", msg))
    return out


def _checkpoint_findings(ck, opts: RunOptions) -> list[Finding]:
    """Where checkpoints go, whether segments can resume from them, how they are saved and how often."""
    if ck.save and (problem := directory_problem(ck.save)):
        msg = f"checkpoint.save: {problem}: move it away, or use another RUN_NAME"
        return [Finding("error", "checkpoint_not_a_directory", msg)]
    out = []
    if opts.job_dir and ck.save and not Path(ck.save).resolve().is_relative_to(Path(opts.job_dir).resolve()):
        msg = f"checkpoint.save={ck.save} is outside the profile's shared job_dir {opts.job_dir}: it would be lost"
        out.append(Finding("error", "checkpoint_outside_job_dir", f"{msg} with the job; use RUN_NAME=<name>"))
    if opts.segments > 1 and not (ck.save and ck.load == ck.save):
        msg = "SEGMENTS>1 needs checkpoint.save = checkpoint.load (RUN_NAME sets both): a later segment would start"
        out.append(Finding("error", "segments_without_checkpoints", f"{msg} from iteration 0"))
    nvrx = ck.async_save and ck.async_strategy == "nvrx"
    if ck.save and nvrx and not importlib.util.find_spec("nvidia_resiliency_ext"):
        msg = (
            "checkpoint.async_save with async_strategy=nvrx needs nvidia-resiliency-ext, not importable here (the NeMo "
            "container ships it; Bridge falls back to mcore without it): SET checkpoint.async_strategy=mcore to be "
            "explicit"
        )
        out.append(Finding("warning", "async_save_needs_nvrx", msg))
    if ck.save and not ck.save_interval:
        msg = "checkpoint.save_interval is null: only the exit save; a crash loses the whole segment"
        out.append(Finding("warning", "no_save_interval", f"{msg} (SET checkpoint.save_interval=<iterations>)"))
    return out


def summary(plan, opts: RunOptions) -> dict:
    """The plan's `run` key: checkpoint directory, save interval and what a crash can lose, segments, Nsight."""
    cfg, ck = plan.cfg, plan.cfg.checkpoint
    # The expected step time is the plan's throughput prediction (sizing/throughput.py), its one home.
    step_s = plan.throughput.step_s if getattr(plan, "throughput", None) is not None else None
    loss_min = round(step_s * ck.save_interval / 60, 1) if step_s and ck.save and ck.save_interval else None
    trace = {"steps": list(opts.torch_profile), "ranks": list(opts.torch_profile_ranks)} if opts.torch_profile else None
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
        "torch_profile": trace,
    }


def lines(d: dict) -> list[str]:
    """The plan's data / checkpoint / segment lines (plain text; report.render_plan prints them)."""
    data, run = d.get("data") or {"mock": True}, d.get("run") or {}
    n = 0 if data["mock"] else len(data["blend"] or [p for ps in data["blend_per_split"].values() for p in ps])
    out = ["data: mock (benchmark)"]
    if not data["mock"]:
        out = [
            f"data: {n} dataset prefix{'es' if n != 1 else ''}, "
            f"{data['tokens']:,} tokens ({data['train_tokens']:,} in the train split); the run reads "
            f"{data['consumed_tokens']:,} = {data['epochs']} epochs; tokenizer {data['tokenizer']}"
        ]
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
    loss = " (no step-time prediction for this plan)"
    if gpu_h:
        loss = f" ≈ {run['crash_loss_min']} min ({gpu_h:,.0f} GPU-hours) at the predicted step time "
        loss += f"{run['expected_step_s']} s"
    out.append(
        f"checkpoints: {run['checkpoint_dir']} every {run['save_interval']} iterations; a crash loses up to "
        f"{run['save_interval']} iterations{loss}"
    )
    wandb = f"; W&B project {run['wandb']['project']}" if run["wandb"] else ""
    out.append(f"tensorboard: {run['tensorboard_dir']}{wandb}")
    if run["exit_duration_in_mins"]:
        out.append(
            f"segments: {run['segments']} chained job(s) (afterany), SIGTERM {PREEMPT_S} s before each limit "
            f"({run['signal']}), exit_duration_in_mins {run['exit_duration_in_mins']}"
        )
    return out
