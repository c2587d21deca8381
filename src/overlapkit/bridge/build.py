"""The plan, made in stages from a request (spec/request.py), each a pure function returning a frozen record of what
the stage before held and what it adds: built → audited → sized → the Plan; then written to a run directory."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import shutil
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio
from overlapkit.bridge import data, flops, inputs, overrides, presets, registry, runopts, stack, startup
from overlapkit.bridge.audit import AuditReport, audit, replaced_overrides
from overlapkit.bridge.env import Ledger, audit_rows, build_ledger
from overlapkit.bridge.overlap import Resolved, apply_overlap_stack, resolve
from overlapkit.bridge.request import loose
from overlapkit.errors import BadInput
from overlapkit.names import inside
from overlapkit.sizing import calibration, hardware, knobs, memory, throughput, worth
from overlapkit.sizing.memory import Workload
from overlapkit.spec import request
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.request import Cluster, PlanRequest
from overlapkit.spec.runopts import OVERRIDES, RunOptions
from overlapkit.spec.shape import ModelShape, dtype_of
from overlapkit.spec.topology import Target, data_parallel_size, expert_data_parallel_size


class PlanError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class Built:
    """The requested recipe built, its run options and SET pairs applied, resolved by Bridge for the target."""

    recipe: registry.Recipe
    request: PlanRequest  # what was asked for, its run options bound to its cluster (spec/request.py)
    cfg: object  # the recipe's ConfigContainer with the run options and overrides applied
    intent: OverlapIntent  # the recipe's, with any overlap.* overrides
    target: Target
    resolved: Resolved
    changes: list  # (key, old, new) per override

    @property
    def site(self) -> Cluster | None:
        """The request's cluster where the job's environment is laid out on it (make submit), else None."""
        return self.request.cluster if self.request.cluster and self.request.cluster.laid_out else None


@dataclass(frozen=True)
class Audited(Built):
    """+ the launch-time environment and the audit of the whole stack (its rows final: the stack's start included)."""

    ledger: Ledger  # with provenance
    report: AuditReport


@dataclass(frozen=True)
class Sized(Audited):
    """+ the memory per GPU and the predicted step."""

    memory: memory.MemoryEstimate  # first pipeline stage, per GPU
    throughput: throughput.Prediction  # step time, tokens/s, TFLOP/s on the target GPU
    worth: dict  # sizing/worth.py: each on overlap's step time when off
    inputs: throughput.Inputs  # what the step was predicted from (inputs.json: what make calibrate re-predicts)


@dataclass(frozen=True)
class Plan(Sized):
    """The plan record: + the run options' and the memory's findings in the report, and plan.json's `run` key."""

    run_summary: dict  # runopts.summary: it quotes the predicted step time

    @property
    def run(self) -> RunOptions:
        """RUN_NAME, SEGMENTS, NSYS, DATA, bound to where the run goes (spec/runopts.py)."""
        return self.request.run

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

    def to_dict(self, run_dir: Path | None = None) -> dict:
        """plan.json; `run_dir`: the run directory it is written in (write_run_dir)."""
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
            "gpu_note": hardware.retarget_note(self.recipe.name, self.target.gpu),  # GPU=h200 on an h100 recipe
            "throughput": self.throughput.to_dict()
            | {
                "overlap_worth": {k: w.to_dict() for k, w in self.worth.items()},  # largest worth first
                "not_modelled": [dataclasses.asdict(k) for k in self.not_modelled],
            },
            "cluster": self.site.name if self.site else None,
            "env": self.ledger.to_dict(),
            "run_dir": str(run_dir) if run_dir else None,
            "data": data.consumption(self.cfg, runopts.data_spec(self.run)),
            "run": self.run_summary,
        }


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def _then(stage: type, before, **adds):
    """The next stage's record: `before`'s fields, with what the stage adds (or replaces)."""
    return stage(**{f.name: getattr(before, f.name) for f in dataclasses.fields(before)} | adds)


def make_plan(
    name: str,
    *,
    nodes: int | None = None,
    sets=None,
    caller_env=None,
    run: RunOptions | None = None,
    gpu: str = hardware.DEFAULT_GPU,
    cluster: Cluster | None = None,
) -> Plan:
    """`plan_for` a request made of loose values (tests, listings, forks, published runs): `nodes` None for the
    recipe's, `sets` SET text or KEY=VALUE tokens, `run` None for a benchmark."""
    return plan_for(dataclasses.replace(loose(name, nodes, sets, run, gpu=gpu), cluster=cluster), caller_env=caller_env)


def plan_for(req: PlanRequest, *, caller_env=None) -> Plan:
    """The request planned, stage by stage: the recipe built and resolved (`built`), its environment laid out and
    its stack audited (`audited`), its memory and step sized (`sized`), then the plan record (`planned`)."""
    return planned(sized(audited(built(req), caller_env)))


def built(req: PlanRequest) -> Built:
    """Build the requested recipe, bind the request to its cluster (here, where the recipe's time limit is known)
    and the config to its run options, apply its SET pairs and resolve for its nodes."""
    entry = registry.get(req.recipe)
    if req.cluster is not None:
        req = request.bind(req, req.cluster, entry.time_limit)
    if req.nodes is not None and req.nodes < 1:
        raise PlanError(f"NODES={req.nodes}: must be a positive number of 8-GPU nodes")
    with stack.silenced():
        cfg = entry.build()
    runopts.apply(cfg, req.run)  # before SET: an explicit override still wins, and is audited
    facts = inputs.recipe_facts(cfg)
    intent_changes, pairs = overrides.split_intent(list(req.sets))
    intent = dataclasses.replace(entry.intent, **intent_changes)
    if intent_changes:  # re-apply the stack with the new intent first, so later config keys still win
        apply_overlap_stack(cfg, intent)
    changes = [(f"{overrides.INTENT_PREFIX}{k}", None, v) for k, v in intent_changes.items()]
    changes += overrides.apply(cfg, pairs)
    if bad := inputs.config_problems(cfg, facts, [k for k, _ in pairs]):  # before anything divides by them
        raise PlanError(bad[0] + (f" (and {len(bad) - 1} more size error(s))" if len(bad) > 1 else ""))
    target = Target(nodes=req.nodes or entry.nodes, gpu=req.gpu)
    return Built(entry, req, cfg, intent, target, resolve(cfg, target), changes)


def audited(b: Built, caller_env=None) -> Audited:
    """Lay out the launch environment (with the cluster's layer where the request's is laid out) and audit the whole
    stack: the overlaps, the replaced overrides, the env rules, and what the stack says at start (each row it drops
    there switched off)."""
    ledger = build_ledger(b, b.site, caller_env)
    parts = audit(b.cfg, b.target, b.resolved, b.intent), replaced_overrides(b.cfg, b.resolved, b.changes)
    parts += (audit_rows(b, ledger),)
    rows = [r for p in parts for r in p.rows]
    rows, said = startup.findings(startup.check(b.cfg, b.target, b.resolved), b.cfg, rows)
    return _then(Audited, b, ledger=ledger, report=AuditReport(rows, [f for p in parts for f in p.findings] + said))


def sized(a: Audited) -> Sized:
    """The memory per GPU; the step predicted with the calibration of the request's cluster where make calibrate
    wrote one (else the published constants), and what each overlap is worth."""
    cal = calibration.for_cluster(a.request.cluster.name if a.request.cluster else None)
    model_in = prediction_inputs(a, cal)  # gathered once: the memory, the prediction and each overlap's worth read it
    est = memory.estimate_workload(model_in.w, a.target.gpu)
    pred = model_in.predict()
    return _then(Sized, a, memory=est, throughput=pred, worth=worth.overlap_worth(model_in, base=pred), inputs=model_in)


def planned(s: Sized) -> Plan:
    """The plan record: the run options' findings (a profiler window the run cannot honour stops the plan here) and
    the memory's after the audit's, and plan.json's `run` key, which quotes the predicted step time."""
    run = runopts.findings(s.cfg, s.request.run, s.request.cluster, s.target.world_size)
    found = s.report.findings + run + memory_findings(s.memory)
    return _then(Plan, s, report=AuditReport(s.report.rows, found), run_summary=runopts.summary(s, s.request.run))


MEMORY_FIX = "more NODES, larger TP/PP/CP, a smaller train.micro_batch_size or model.seq_length, or recompute"


def memory_findings(est: memory.MemoryEstimate) -> list[Finding]:
    """Beyond the GPU's memory: an error (the job would stop at its first step). Inside the fragmentation margin
    only: a warning (the margin is the estimate's error bar; `make new-recipe` keeps no layout there)."""
    if est.fits:
        return []
    if est.over_hbm:
        return [Finding("error", "memory_does_not_fit", f"{est.summary()}: {MEMORY_FIX}")]
    return [Finding("warning", "memory_tight", f"{est.summary()}: one allocator spike from an OOM; {MEMORY_FIX}")]


def workload_of(cfg, target: Target) -> Workload:
    """The Workload a Bridge ConfigContainer describes on `target` (DP from topology.data_parallel_size)."""
    m, mp, comm = cfg.model, cfg.mixed_precision, cfg.comm_overlap
    real_mp = mp is not None and not isinstance(mp, str)
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    # Decoder layers in each model chunk of pipeline rank 0 when the recipe gives an explicit layout (DeepSeek-V3's
    # `Et|(tt|)*30mL`), parsed by Megatron Core's own PipelineParallelLayerLayout; None for an even split.
    first_chunks = None
    if m.pipeline_model_parallel_layout is not None and pp > 1:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout(m.pipeline_model_parallel_layout, pp).layout[0]
        first_chunks = tuple(sum(getattr(x, "name", x) == "decoder" for x in chunk) for chunk in stages)
    return Workload(
        ModelShape.of(cfg),
        tp=tp,
        pp=pp,
        vpp=m.virtual_pipeline_model_parallel_size,
        cp=m.context_parallel_size or 1,
        dp=data_parallel_size(cfg, target.world_size),
        mbs=cfg.train.micro_batch_size,
        gbs=cfg.train.global_batch_size,
        sequence_parallel=bool(m.sequence_parallel or tp == 1),
        tp_overlap=bool(comm is not None and comm.tp_comm_overlap and tp > 1 and target.te_available),  # else no UB
        fp8_param_gather=bool(real_mp and mp.fp8_param_gather),
        grad_fp32=bool(mp.grad_reduce_in_fp32 if real_mp else cfg.ddp.grad_reduce_in_fp32),  # mp overwrites ddp
        distributed_optimizer=bool(cfg.ddp.use_distributed_optimizer),
        recompute=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        mb_group=getattr(m, "microbatch_group_size_per_vp_stage", None),
        ep=m.expert_model_parallel_size or 1,
        etp=m.expert_tensor_parallel_size or 1,
        expert_dp=expert_data_parallel_size(m, target.world_size),
        recompute_modules=tuple(m.recompute_modules or ()) if m.recompute_granularity == "selective" else (),
        first_chunks=first_chunks,
        fp8_recipe=(mp.fp8_recipe if real_mp and mp.fp8 else None) or "tensorwise",
    )


def prediction_inputs(plan: Audited, cal: calibration.Calibration = calibration.PUBLISHED) -> throughput.Inputs:
    """What the throughput model reads of the plan (model_inputs), with the calibration `cal`."""
    return model_inputs(plan.cfg, plan.resolved, plan.report.rows, plan.target, cal)


def model_inputs(cfg, res: Resolved, rows, target: Target, cal: calibration.Calibration) -> throughput.Inputs:
    """What the throughput model reads of `cfg` resolved by Bridge (`res`) for `target`, the overlaps on as its audit
    `rows` say: the one derivation of a prediction's inputs, the plan's and the layout search's for each layout."""
    states = {r.name: r.state for r in rows}
    overlaps = throughput.Overlaps.of_rows(
        states, ep_default=bool(getattr(res.model, "overlap_moe_expert_parallel_comm", False))
    )
    return throughput.Inputs(
        workload_of(cfg, target),
        flops.flops_of_config(cfg),
        overlaps,
        throughput.Moe.of_model(cfg.model),
        res.ddp.bucket_size,
        target.gpu,
        cal,
    )


def write_run_dir(plan: Plan, root: Path, stamp: str | None = None) -> Path:
    """runs/<recipe>-<UTC time>/{plan.json,config.yaml,ledger.json,overrides.json,inputs.json}; never overwrites an
    earlier run. A folder that cannot take it (read-only, full, not ours to write) is one line naming the fix, and the
    run directory begun is removed: never half a run."""
    stamp = stamp or dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        run_dir = _new_dir(inside(root, f"{plan.recipe.name}-{stamp}"))
        _write_run_files(plan, run_dir)
    except OSError as exc:
        if run_dir is not None:
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
    jsonio.write_json(run_dir / "plan.json", plan.to_dict(run_dir))
    # What the in-job preflight compares each rank's environment with (secrets by name only).
    ledger = {"values": plan.ledger.values(), "secrets": plan.ledger.secrets, **plan.ledger.to_dict()}
    jsonio.write_json(run_dir / "ledger.json", ledger)
    jsonio.write_json(run_dir / OVERRIDES, overrides_record(plan))
    jsonio.write_json(run_dir / throughput.INPUTS, throughput.inputs_record(plan.inputs))


def overrides_record(plan: Plan) -> dict:
    return {
        "recipe": plan.recipe.name,
        "nodes": plan.target.nodes,
        "gpu": plan.target.gpu,
        "set": [list(p) for p in plan.request.sets],
        "run": plan.request.run.to_dict(),
    }
