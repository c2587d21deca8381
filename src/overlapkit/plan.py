"""The plan: recipe + overrides + target → resolved, audited, and written to a run directory."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import memory, overrides, presets, stack
from overlapkit.audit import AuditReport, Finding, audit
from overlapkit.overlap import Resolved, Target, apply_overlap_stack, dtype_of, intent_of, resolve, total_params


class PlanError(ValueError):
    """One-line, user-facing."""


@dataclass
class Plan:
    recipe: object  # recipes._base.Recipe
    cfg: object  # the recipe's ConfigContainer with overrides applied
    target: Target
    resolved: Resolved
    report: AuditReport
    changes: list = field(default_factory=list)
    ledger: object = None  # envvars.Ledger: the launch-time environment with provenance
    profile: object = None  # profiles.ClusterProfile, when planned for a cluster
    memory: object = None  # memory.MemoryEstimate for the first pipeline stage, computed once in make_plan
    run_dir: Path | None = None

    @property
    def layout(self) -> dict:
        m, t = self.cfg.model, self.cfg.train
        return {
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
            "params_b": round(total_params(m, self.cfg.tokenizer.vocab_size) / 1e9, 1),
        }

    def memory_dict(self) -> dict:
        est = self.memory
        rows = [{"component": c, "gb": round(gb, 2), "note": n} for c, gb, n in est.rows()]
        return {"total_gb": round(est.total_gb, 2), "fits": est.fits, "budget_gb": est.budget_gb, "rows": rows}

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "source": self.recipe.source,
            "time_limit": self.recipe.time_limit,
            "layout": self.layout,
            "overrides": [{"key": k, "old": _jsonable(o), "new": _jsonable(n)} for k, o, n in self.changes],
            "audit": self.report.to_dict(),
            "memory": self.memory_dict(),
            "cluster": self.profile.name if self.profile else None,
            "env": self.ledger.to_dict() if self.ledger else None,
            "run_dir": str(self.run_dir) if self.run_dir else None,
        }


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)


def make_plan(
    name: str, *, nodes: int | None = None, sets=None, te_available: bool = True, profile=None, caller_env=None
) -> Plan:
    """Build recipe `name`, apply `sets` (dotted overrides), resolve for `nodes` (default: the recipe's), build the
    launch environment ledger (with `profile`'s layer when given) and audit the whole stack, env rules included."""
    import recipes
    from overlapkit.envvars import build_ledger

    entry = recipes.get(name)
    with stack.silenced():
        cfg = entry.build()
    intent_changes, pairs = overrides.split_intent(overrides.parse(sets))
    if intent_changes:  # re-apply the stack with the new intent first, so later config keys still win
        apply_overlap_stack(cfg, dataclasses.replace(intent_of(cfg), **intent_changes))
    changes = [(f"{overrides.INTENT_PREFIX}{k}", None, v) for k, v in intent_changes.items()]
    changes += overrides.apply(cfg, pairs)
    if nodes is not None and nodes < 1:
        raise PlanError(f"NODES={nodes}: must be a positive number of 8-GPU nodes")
    target = Target(nodes=nodes or entry.nodes, te_available=te_available)
    res = resolve(cfg, target)
    plan = Plan(entry, cfg, target, res, AuditReport(), changes, profile=profile)
    plan.ledger = build_ledger(plan, profile, caller_env)
    plan.memory = memory.estimate(cfg, target)
    plan.report = audit(cfg, target, res, env=plan.ledger.values())
    # Layer conflicts join the audit; a CUDA_DEVICE_MAX_CONNECTIONS override is already the audit's own error.
    dup = "cuda_max_connections" in plan.report.codes()
    plan.report.findings += [
        Finding(c.level, "env_conflict", c.message)
        for c in plan.ledger.conflicts
        if not (dup and c.name == "CUDA_DEVICE_MAX_CONNECTIONS")
    ]
    return plan


def resolved_config(plan: Plan):
    """The recipe config with Bridge's resolved model/optimizer/ddp/comm_overlap swapped in."""
    cfg = copy.copy(plan.cfg)
    r = plan.resolved
    cfg.model, cfg.optimizer, cfg.ddp, cfg.comm_overlap = r.model, r.optimizer, r.ddp, r.comm
    return cfg


def write_run_dir(plan: Plan, root: Path, stamp: str | None = None) -> Path:
    """runs/<recipe>-<UTC time>/{plan.json,config.yaml}; never overwrites an earlier run."""
    stamp = stamp or dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    base = root / f"{plan.recipe.name}-{stamp}"
    run_dir, i = base, 1
    while run_dir.exists():
        run_dir, i = Path(f"{base}.{i}"), i + 1
    run_dir.mkdir(parents=True)
    plan.run_dir = run_dir
    resolved_config(plan).to_yaml(str(run_dir / "config.yaml"))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    # What the in-job preflight compares each rank's environment with (secrets by name only).
    ledger = {"values": plan.ledger.values(), "secrets": plan.ledger.secrets, **plan.ledger.to_dict()}
    (run_dir / "ledger.json").write_text(json.dumps(ledger, indent=2) + "\n")
    return run_dir
