"""The plan: recipe + overrides + target → resolved, audited, and written to a run directory."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import shutil
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio
from overlapkit.bridge import data, flops, inputs, overrides, presets, registry, runopts, stack, startup
from overlapkit.bridge.audit import AuditReport, Finding, audit, replaced_overrides
from overlapkit.bridge.env import Ledger, audit_rows, build_ledger
from overlapkit.bridge.overlap import OverlapIntent, Resolved, apply_overlap_stack, resolve
from overlapkit.bridge.request import loose
from overlapkit.errors import BadInput
from overlapkit.names import inside
from overlapkit.sizing import calibration, hardware, knobs, memory, throughput, worth
from overlapkit.spec import request
from overlapkit.spec.request import PlanRequest
from overlapkit.spec.runopts import OVERRIDES, RunOptions
from overlapkit.spec.shape import ModelShape, dtype_of
from overlapkit.spec.topology import Target, expert_data_parallel_size


class PlanError(BadInput):
    """One-line, user-facing."""


@dataclass
class Plan:
    """A recipe planned for a target: built, overridden, resolved by Bridge, audited, sized, its environment laid."""

    recipe: registry.Recipe
    cfg: object  # the recipe's ConfigContainer with overrides applied
    intent: OverlapIntent  # the recipe's, with any overlap.* overrides
    target: Target
    resolved: Resolved
    report: AuditReport
    changes: list  # (key, old, new) per override
    ledger: Ledger  # the launch-time environment with provenance
    memory: memory.MemoryEstimate  # first pipeline stage, per GPU
    profile: object = None  # cluster.profiles.ClusterProfile, when planned for a cluster
    run_dir: Path | None = None
    throughput: throughput.Prediction | None = None  # step time, tokens/s, TFLOP/s on the target GPU
    request: PlanRequest | None = None  # what was asked for, its run options bound (spec/request.py)
    worth: dict = dataclasses.field(default_factory=dict)  # sizing/worth.py: each on overlap's step time when off
    run_summary: dict | None = None  # plan.json's `run` key (runopts.summary), made once the step time is known

    @property
    def gpu_note(self) -> str | None:
        """One line when the plan is for another GPU than the recipe's name says (GPU=h200 on an h100 recipe)."""
        return hardware.retarget_note(self.recipe.name, self.target.gpu)

    @property
    def run(self) -> RunOptions:
        """RUN_NAME, SEGMENTS, NSYS, DATA, bound to where the run goes (spec/runopts.py)."""
        return self.request.run

    @property
    def sets(self) -> list:
        """The SET pairs as typed: (key, raw text)."""
        return list(self.request.sets)

    @property
    def layout(self) -> dict:
        m, t = self.cfg.model, self.cfg.train
        shape = ModelShape.of(self.cfg)
        moe = {}
        if shape.is_moe:
            moe = {
                "ep": m.expert_model_parallel_size,
                "etp": m.expert_tensor_parallel_size or 1,
                "expert_dp": expert_data_parallel_size(m, self.target.world_size),
                "experts": shape.experts,
                "topk": shape.topk,
                "active_params_b": round(shape.active_params / 1e9, 1),
            }
        return moe | {
            "model": self.recipe.model,
            "nodes": self.target.nodes,
            "gpus": self.target.world_size,
            "tp": m.tensor_model_parallel_size,
            "pp": m.pipeline_model_parallel_size,
            "cp": m.context_parallel_size or 1,
            "vpp": m.virtual_pipeline_model_parallel_size,
            "dp": self.resolved.data_parallel_size,
            "mbs": t.micro_batch_size,
            "gbs": t.global_batch_size,
            "seq": m.seq_length,
            "dtype": dtype_of(self.cfg),
            "preset": presets.name_of(self.cfg.comm_overlap.tp_comm_overlap_cfg) if self.cfg.comm_overlap else None,
            "params_b": round(shape.total_params / 1e9, 1),
        }

    @property
    def not_modelled(self) -> list[knobs.Knob]:
        """What the plan sets that moves its step and the throughput model does not price (sizing/knobs.py)."""
        return knobs.not_modelled(self.resolved.model, self.cfg.train)

    def to_dict(self) -> dict:
        est = self.memory
        rows = [{"component": c, "gb": round(gb, 2), "note": n} for c, gb, n in est.rows()]
        return {
            "recipe": self.recipe.name,
            "source": self.recipe.source,
            "time_limit": self.recipe.time_limit,
            "layout": self.layout,
            "overrides": [{"key": k, "old": _jsonable(o), "new": _jsonable(n)} for k, o, n in self.changes],
            "audit": self.report.to_dict(),
            "memory": {"total_gb": round(est.total_gb, 2), "fits": est.fits, "budget_gb": est.budget_gb, "rows": rows},
            "gpu": self.target.gpu,
            "gpu_note": self.gpu_note,
            "throughput": self.throughput.to_dict()
            | {"overlap_worth": worth.to_dict(self.worth), "not_modelled": [k.to_dict() for k in self.not_modelled]}
            if self.throughput
            else None,
            "cluster": self.profile.name if self.profile else None,
            "env": self.ledger.to_dict() if self.ledger else None,
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "data": data.consumption(self.cfg, runopts.data_spec(self.run)),
            "run": self.run_summary,
        }


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def make_plan(
    name: str,
    *,
    nodes: int | None = None,
    sets=None,
    te_available: bool = True,
    profile=None,
    caller_env=None,
    run: RunOptions | None = None,
    gpu: str = hardware.DEFAULT_GPU,
    cluster: str | None = None,
) -> Plan:
    """`plan_for` a request made of loose values (tests, listings, forks, published runs): recipe `name`, `nodes`
    (default: the recipe's), `sets` (SET text or KEY=VALUE tokens), `run` (a benchmark by default), `gpu`."""
    req = loose(name, nodes, sets, run, gpu=gpu)
    return plan_for(req, te_available=te_available, profile=profile, caller_env=caller_env, cluster=cluster)


def plan_for(
    req: PlanRequest, *, te_available: bool = True, profile=None, caller_env=None, cluster: str | None = None
) -> Plan:
    """Build the requested recipe, bind it to the request's run options (checkpoints, data, segments, Nsight), apply
    its SET pairs, resolve for its nodes, lay out the launch environment (with `profile`'s layer when given) and
    audit the whole stack, env rules included. The throughput is predicted with the calibration of the request's
    cluster (else `cluster`, a profile's name, for callers that plan without one: listings, forks; else `profile`'s)
    where make calibrate wrote one, else the published constants."""
    entry = registry.get(req.recipe)
    if req.cluster is not None:  # bound here, where the recipe's time limit (the profile's default) is known
        req = request.bind(req, req.cluster, entry.time_limit)
    if req.nodes is not None and req.nodes < 1:
        raise PlanError(f"NODES={req.nodes}: must be a positive number of 8-GPU nodes")
    with stack.silenced():
        cfg = entry.build()
    runopts.apply(cfg, req.run)  # before SET: an explicit override still wins, and is audited
    facts = inputs.recipe_facts(cfg)
    typed = list(req.sets)
    intent_changes, pairs = overrides.split_intent(typed)
    intent = dataclasses.replace(entry.intent, **intent_changes)
    if intent_changes:  # re-apply the stack with the new intent first, so later config keys still win
        apply_overlap_stack(cfg, intent)
    changes = [(f"{overrides.INTENT_PREFIX}{k}", None, v) for k, v in intent_changes.items()]
    changes += overrides.apply(cfg, pairs)
    if bad := inputs.config_problems(cfg, facts, [k for k, _ in pairs]):  # before anything divides by them
        raise PlanError(bad[0] + (f" (and {len(bad) - 1} more size error(s))" if len(bad) > 1 else ""))
    target = Target(nodes=req.nodes or entry.nodes, gpu=req.gpu, te_available=te_available)
    res = resolve(cfg, target)
    partial = Plan(entry, cfg, intent, target, res, AuditReport(), changes, Ledger(), None, profile, request=req)
    ledger = build_ledger(partial, profile, caller_env)
    report = audit(cfg, target, res, intent).extend(replaced_overrides(cfg, res, changes))
    report.extend(audit_rows(partial, ledger))
    report.extend(startup.findings(startup.check(cfg, target, res), cfg, report))
    est = memory.estimate(cfg, target)
    plan = dataclasses.replace(partial, report=report, ledger=ledger, memory=est)
    cal = calibration.for_cluster(req.cluster.name if req.cluster else cluster or (profile.name if profile else None))
    model_in = prediction_inputs(plan, cal)  # gathered once: the prediction and each overlap's worth read the same
    plan.throughput = model_in.predict()
    plan.worth = worth.overlap_worth(model_in, base=plan.throughput)
    # The run options last, once the step time is predicted: their findings (a profiler window the run cannot honour
    # stops the plan here), the memory's, and the plan's `run` key, which quotes the predicted step time.
    report.findings += [Finding(*f) for f in runopts.findings(cfg, req.run, profile, target.world_size)]
    report.findings += memory_findings(est)
    plan.run_summary = runopts.summary(plan, req.run)
    return plan


MEMORY_FIX = "more NODES, larger TP/PP/CP, a smaller train.micro_batch_size or model.seq_length, or recompute"


def memory_findings(est: memory.MemoryEstimate) -> list[Finding]:
    """Beyond the GPU's memory: an error (the job would stop at its first step). Inside the fragmentation margin
    only: a warning (the margin is the estimate's error bar; `make new-recipe` keeps no layout there)."""
    if est.fits:
        return []
    if est.over_hbm:
        return [Finding("error", "memory_does_not_fit", f"{est.summary()}: {MEMORY_FIX}")]
    return [Finding("warning", "memory_tight", f"{est.summary()}: one allocator spike from an OOM; {MEMORY_FIX}")]


def prediction_inputs(plan: Plan, cal: calibration.Calibration = calibration.PUBLISHED) -> throughput.Inputs:
    """What the throughput model reads of the plan (model_inputs), with the calibration `cal`."""
    return model_inputs(plan.cfg, plan.resolved, plan.report.rows, plan.target, cal)


def model_inputs(cfg, res: Resolved, rows, target: Target, cal: calibration.Calibration) -> throughput.Inputs:
    """What the throughput model reads of a recipe's config `cfg` resolved by Bridge (`res`) for `target`: its
    workload, Bridge's FLOPs, the overlaps its audit `rows` say are on, its MoE settings, its DDP bucket and the
    target GPU; with the calibration `cal`. The one derivation of a prediction's inputs: the plan's, and the layout
    search's for each layout it ranks (fork/layout_search.py)."""
    states = {r.name: r.state for r in rows}
    overlaps = throughput.Overlaps.of_rows(
        states, ep_default=bool(getattr(res.model, "overlap_moe_expert_parallel_comm", False))
    )
    return throughput.Inputs(
        memory.workload_of(cfg, target),
        flops.flops_of_config(cfg),
        overlaps,
        throughput.Moe.of_model(cfg.model),
        res.ddp.bucket_size,
        target.gpu,
        cal,
    )


def write_run_dir(plan: Plan, root: Path, stamp: str | None = None) -> Path:
    """runs/<recipe>-<UTC time>/{plan.json,config.yaml,ledger.json,overrides.json}; never overwrites an earlier run.
    A folder that cannot take it (read-only, full, not ours to write) is one line naming the fix, and the run
    directory begun is removed: never half a run."""
    stamp = stamp or dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        run_dir = plan.run_dir = _new_dir(inside(root, f"{plan.recipe.name}-{stamp}"))  # plan.json names it
        _write_run_files(plan, run_dir)
    except OSError as exc:
        if run_dir is not None:
            plan.run_dir = None
            shutil.rmtree(run_dir, ignore_errors=True)
        where = exc.filename or root
        raise BadInput(
            f"cannot write the run directory under {root} ({exc.strerror or exc}: {where}): nothing written; give a "
            "job directory you can write with free space (the profile's job_dir, or JOB_DIR=)"
        ) from None
    return run_dir


def _new_dir(base: Path) -> Path:
    """`base`, or base.1, base.2, ...: mkdir is the test, so two plans typed in the same second each get their own."""
    run_dir, i = base, 1
    while True:
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            run_dir, i = Path(f"{base}.{i}"), i + 1


def _write_run_files(plan: Plan, run_dir: Path) -> None:
    import yaml
    from megatron.training.config.yaml_utils import safe_yaml_representers

    cfg, r = copy.copy(plan.cfg), plan.resolved  # the recipe's config with Bridge's resolved parts swapped in
    cfg.model, cfg.optimizer, cfg.ddp, cfg.comm_overlap = r.model, r.optimizer, r.ddp, r.comm
    # ConfigContainer.to_yaml's own dump (megatron/training/config/container.py), written by jsonio: to_yaml opens
    # the path itself, through a link planted there, and a crash mid-write would leave half a file
    with safe_yaml_representers():
        jsonio.write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), default_flow_style=False))
    jsonio.write_json(run_dir / "plan.json", plan.to_dict())
    # What the in-job preflight compares each rank's environment with (secrets by name only).
    ledger = {"values": plan.ledger.values(), "secrets": plan.ledger.secrets, **plan.ledger.to_dict()}
    jsonio.write_json(run_dir / "ledger.json", ledger)
    jsonio.write_json(run_dir / OVERRIDES, overrides_record(plan))


def overrides_record(plan: Plan) -> dict:
    return {
        "recipe": plan.recipe.name,
        "nodes": plan.target.nodes,
        "gpu": plan.target.gpu,
        "set": [list(p) for p in plan.request.sets],
        "run": plan.request.run.to_dict(),
    }
