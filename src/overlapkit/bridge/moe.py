"""The mixture-of-experts part of the audit: the EP overlap rows, Bridge's MoE overlap asserts as one-line findings
with their fix, the expert-side divisibility rules, and the dispatcher backend the target must have.

Bridge checks the EP overlap's prerequisites only with bare `assert`s at setup on the GPUs
(megatron/bridge/training/comm_overlap.py, `CommOverlapConfig._get_model_comm_overlap_cfgs`): stated once here, so a
plan names the fix before a job starts (tests/unit_tests/training/test_comm_overlap.py trips each both ways).
"""

from __future__ import annotations

import importlib.util

from packaging.version import Version

from overlapkit.bridge.overlap import is_moe
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import NA, OFF, ON, Overlap
from overlapkit.spec.shape import ModelShape
from overlapkit.spec.topology import expert_data_parallel_size

EP_OVERLAP = Overlap.EP.field
DELAY_WGRAD = "comm_overlap.delay_wgrad_compute"
# The packages Megatron Core's moe/fused_a2a.py imports each flex backend from (ncclep: TE's NCCL EP path).
BACKEND_MODULE = {"deepep": "deep_ep", "hybridep": "deep_ep", "ncclep": "transformer_engine.pytorch.ep"}
TE_FOR_DELAY_WGRAD = "2.7.0"  # Bridge asserts is_te_min_version("2.7.0") for delay_wgrad with grad-reduce overlap


def _ep_overlap_asserts(cfg, rm) -> list[tuple[bool, str, str, str | None]]:
    """Bridge's EP overlap asserts in its order, each (holds, code, why, SET fix): what the overlap runs on, the
    recompute settings it cannot run with, and the MoE features that cannot run beside it."""
    m, off = cfg.model, f"{EP_OVERLAP}=false"
    # The fix for "EP overlap with PP needs VPP": a virtual-pipeline size that splits the layers evenly.
    units = ModelShape.of(cfg).pipeline_units
    vpp = next((v for v in range(2, 9) if units % (m.pipeline_model_parallel_size * v) == 0), None)
    mods = ",".join(x for x in (m.recompute_modules or []) if x != "moe")
    kind = m.moe_token_dispatcher_type
    return [
        ((m.expert_model_parallel_size or 1) > 1, "ep_overlap_needs_ep", "needs expert_model_parallel_size>1", off),
        ((m.num_moe_experts or 0) > 1, "ep_overlap_needs_experts", "needs num_moe_experts>1", off),
        (
            kind in ("alltoall", "flex"),
            "ep_overlap_dispatcher",
            f"needs the alltoall or flex dispatcher, not {kind!r}",
            "model.moe_token_dispatcher_type=alltoall",
        ),
        (bool(rm.bf16 or rm.fp16), "ep_overlap_dtype", "needs bf16 or fp16 params", "mixed_precision.bf16=true"),
        (
            m.pipeline_model_parallel_size == 1 or m.virtual_pipeline_model_parallel_size is not None,
            "ep_overlap_needs_vpp",
            "with PP>1 needs a virtual pipeline (VPP)",
            f"model.virtual_pipeline_model_parallel_size={vpp}" if vpp else None,
        ),
        (
            m.recompute_granularity != "full",
            "ep_overlap_full_recompute",
            "cannot run with full recompute",
            "model.recompute_granularity=selective",
        ),
        (
            m.recompute_method is None,
            "ep_overlap_recompute_method",
            "needs recompute_method unset",
            "model.recompute_method=null",
        ),
        (
            m.recompute_num_layers is None,
            "ep_overlap_recompute_layers",
            "needs recompute_num_layers unset",
            "model.recompute_num_layers=null",
        ),
        (
            "moe" not in (m.recompute_modules or []),
            "ep_overlap_recompute_moe",
            "cannot recompute the 'moe' module",
            f"model.recompute_modules=[{mods}]",
        ),
        (
            not m.moe_shared_expert_overlap,
            "ep_overlap_shared_expert",
            "cannot run with shared-expert overlap",
            "model.moe_shared_expert_overlap=false",
        ),
        (
            m.mtp_num_layers in (None, 0, 1),
            "ep_overlap_mtp",
            "supports at most one MTP layer",
            "model.mtp_num_layers=1",
        ),
    ]


def expert_split_violations(*, experts: int, ep: int, etp: int, pp: int, world: int, ffn: int) -> list[tuple]:
    """(code, message) for each expert-side divisibility rule a split breaks, on bare numbers: one source for the
    audit (on a built config) and layout_search (candidate splits, no configs)."""
    out = []
    if experts % ep:
        why = "each EP rank holds whole experts; change model.expert_model_parallel_size"
        out.append(("experts_not_divisible_ep", f"{experts} experts are not divisible by EP{ep}: {why}"))
    if world % (etp * ep * pp):
        why = "the expert side of the grid is ETP·EP·PP·expert-DP; change EP or the node count"
        out.append(
            ("expert_world_not_divisible", f"{world} GPUs are not divisible by ETP·EP·PP={etp}·{ep}·{pp}: {why}")
        )
    if ffn % etp:
        why = "change model.expert_tensor_parallel_size"
        out.append(("expert_ffn_not_divisible_etp", f"expert FFN {ffn} is not divisible by ETP{etp}: {why}"))
    return out


def importable(module: str) -> bool:
    """Can this process import `module`? (found without running it; a missing parent package: not importable)"""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def backend_problem(model, gpu_node: bool, have=importable) -> tuple[str, str] | None:
    """(level, message) when the flex dispatcher's backend (DeepEP/HybridEP) is not importable here: an error on a
    GPU node (the job would fail at its first MoE layer), a note on a CPU planning machine (the container has it).
    `have(module)` answers whether a package is importable; tests pass the answer, whatever this machine has."""
    backend = model.moe_flex_dispatcher_backend if model.moe_token_dispatcher_type == "flex" else None
    if (module := BACKEND_MODULE.get(backend)) is None or have(module):
        return None
    fix = "model.moe_token_dispatcher_type=alltoall model.moe_flex_dispatcher_backend=null"
    if gpu_node:
        msg = f"flex dispatcher backend {backend} needs the {module} package, which is not importable on this GPU node"
        return "error", f"{msg}: use the NeMo container or set {fix}"
    return "note", f"{module} not importable on this CPU machine: the NeMo container on the GPU nodes provides it"


def rows_and_findings(cfg, target, res, intent) -> tuple[list[tuple], list[Finding]]:
    """(name, state, why) rows and findings for an MoE model; ([], []) for a dense one. The findings first: each
    assert Bridge's setup would trip (on the config as written), then the expert split's divisibility rules."""
    m, rm, comm_user, findings = cfg.model, res.model, cfg.comm_overlap, []
    if not is_moe(m):
        return [], []
    requested = bool(comm_user is not None and comm_user.overlap_moe_expert_parallel_comm)
    if requested:
        for ok, code, why, fix in _ep_overlap_asserts(cfg, rm):
            if not ok:
                msg = f"EP all-to-all overlap {why} (Bridge asserts at setup); set {fix}"
                findings.append(Finding("error", code, msg, fix))
    if comm_user is not None and comm_user.delay_wgrad_compute:  # delay_wgrad_compute's own asserts
        fix, te = f"{DELAY_WGRAD}=false", target.te_version
        if not (m.overlap_moe_expert_parallel_comm or comm_user.overlap_moe_expert_parallel_comm):
            msg = f"delay_wgrad_compute needs EP all-to-all overlap (Bridge asserts at setup); set {fix} or "
            msg += f"{EP_OVERLAP}=true"
            findings.append(Finding("error", "delay_wgrad_needs_ep_overlap", msg, fix))
        needs_te = res.ddp.overlap_grad_reduce or comm_user.overlap_grad_reduce or m.gradient_accumulation_fusion
        if needs_te and te is not None and Version(te) < Version(TE_FOR_DELAY_WGRAD):
            msg = (
                f"delay_wgrad_compute with grad-reduce overlap or gradient accumulation fusion needs TE >= "
                f"{TE_FOR_DELAY_WGRAD}, the target has {te}; use a newer container or set {fix}"
            )
            findings.append(Finding("error", "delay_wgrad_te_version", msg, fix))
    if res.bridge_asserts and not findings:  # an assert this module does not know yet: never silent
        findings += [Finding("error", "bridge_assert", f"Bridge's setup asserts: {msg}") for msg in res.bridge_asserts]
    expert_split = expert_split_violations(
        experts=m.num_moe_experts,
        ep=m.expert_model_parallel_size or 1,
        etp=m.expert_tensor_parallel_size or 1,
        pp=m.pipeline_model_parallel_size,
        world=target.world_size,
        ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size,
    )
    findings += [Finding("error", c, msg) for c, msg in expert_split]
    return _rows(m, res, intent, findings, requested, target.world_size), findings


def _rows(m, res, intent, findings, requested: bool, world: int) -> list[tuple]:
    """The five MoE rows in the audit's order: EP all-to-all overlap, delayed expert wgrad, shared-expert overlap,
    the dispatcher, expert-DP overlap. A missing EP overlap or dispatcher backend adds its finding."""
    rm, ep, rows = res.model, m.expert_model_parallel_size or 1, []
    if ep == 1:
        rows.append((Overlap.EP, NA, "EP=1: no expert all-to-all"))
    elif rm.overlap_moe_expert_parallel_comm:
        why = f"EP={ep}: dispatch/combine all-to-all overlapped with another microbatch's compute"
        rows.append((Overlap.EP, ON, why))
    elif why := intent.why_off(Overlap.EP):
        rows.append((Overlap.EP, OFF, f"kept off: {why}"))
    elif requested and findings:  # Bridge's setup would assert: the findings name the prerequisite and its fix
        rows.append((Overlap.EP, OFF, f"EP={ep}: requested, but a prerequisite fails (see the errors)"))
    else:
        msg = f"EP={ep} without EP all-to-all overlap: set {EP_OVERLAP}=true"
        findings.append(Finding("error", "ep_overlap_off", msg, f"{EP_OVERLAP}=true"))
        rows.append((Overlap.EP, OFF, f"EP={ep} but {EP_OVERLAP} is off"))
    if not rm.overlap_moe_expert_parallel_comm:
        rows.append(("delay_wgrad_compute", NA, "needs EP all-to-all overlap"))
    elif rm.delay_wgrad_compute:
        why = f"expert wgrad GEMMs delayed to overlap the combine a2a (TE >= {TE_FOR_DELAY_WGRAD})"
        rows.append(("delay_wgrad_compute", ON, why))
    else:
        rows.append(("delay_wgrad_compute", OFF, "wgrad computed in place (the recipe's choice, as NVIDIA's)"))
    if not m.moe_shared_expert_intermediate_size:
        shared = NA, "no shared experts"
    elif rm.moe_shared_expert_overlap:
        shared = ON, "shared-expert MLP overlapped with the dispatch all-to-all"
    elif rm.overlap_moe_expert_parallel_comm:
        shared = OFF, "EP all-to-all overlap already hides it (Bridge forbids both)"
    elif m.moe_token_dispatcher_type == "flex":
        shared = OFF, "flex dispatcher: Bridge's flex setup switches it off"
    else:
        shared = OFF, "model.moe_shared_expert_overlap=false"
    rows.append(("moe_shared_expert_overlap", *shared))
    kind = m.moe_token_dispatcher_type
    detail = f"flex / {m.moe_flex_dispatcher_backend}" if kind == "flex" else kind
    if kind == "flex" and m.moe_flex_dispatcher_backend == "hybridep":
        detail += f" ({m.moe_hybridep_num_sms} SMs)"
    import torch

    if problem := backend_problem(m, torch.cuda.is_available()):
        level, msg = problem
        if level == "note":
            detail += f"; {msg}"
        else:
            findings.append(Finding(level, "dispatcher_backend_missing", msg))
    rows.append(("moe_dispatcher", ON, detail))
    edp, rddp = expert_data_parallel_size(m, world), res.ddp
    if edp == 1:
        rows.append(
            ("expert_dp_overlap", NA, f"expert-DP=1 (ETP·EP·PP = {world} GPUs): expert grads need no DP reduce")
        )
    elif rddp.overlap_grad_reduce and rddp.overlap_param_gather:
        why = f"expert-DP={edp}: expert grad reduce-scatter / param all-gather overlapped"
        rows.append(("expert_dp_overlap", ON, why))
    else:
        why = intent.why_off(Overlap.RS)
        off = f"expert-DP={edp}: " + (f"grad reduce kept off: {why}" if why else "DP overlap off")
        rows.append(("expert_dp_overlap", OFF, off))
    return rows
