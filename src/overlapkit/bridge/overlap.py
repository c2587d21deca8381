"""Apply the full overlap stack to a Bridge ConfigContainer, and resolve what a run will really get.

`resolve` runs Bridge's own `MixedPrecisionConfig.setup` and `CommOverlapConfig.finalize/setup` on copies of the
recipe's model/optimizer/ddp configs for the planned world size. Those are pure dataclass manipulations (no
torch.distributed, no CUDA), so they are safe on CPU. We never re-implement Bridge's gating; we only read its result.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import logging.handlers
import sys
from dataclasses import dataclass, field

from overlapkit.bridge import presets
from overlapkit.spec.overlap import Overlap, OverlapIntent
from overlapkit.spec.topology import DEFAULT_GPU, Target, data_parallel_size


@dataclass
class Resolved:
    """Bridge's effective configs for one planned world size, plus what Bridge said while deciding."""

    model: object
    ddp: object
    optimizer: object
    comm: object
    data_parallel_size: int
    bridge_warnings: list[str] = field(default_factory=list)
    bridge_asserts: list[str] = field(default_factory=list)  # MoE overlap prerequisites Bridge's setup asserted


def apply_overlap_stack(cfg, intent: OverlapIntent | None = None, *, gpu: str = DEFAULT_GPU):
    """Switch on every overlap the layout allows. Mutates and returns `cfg`; raises PresetError on no preset.
    One step per overlap group, in the audit's order: TP (with the pipeline knobs kept), EP, DP, precision."""
    intent = intent or OverlapIntent()
    comm = _tp_overlap(cfg, intent, gpu)
    # Keep pipeline-bubble knobs the base recipe chose (e.g. GPT3 175B's deferred embedding wgrad).
    if (old := cfg.comm_overlap) is not None:
        comm.defer_embedding_wgrad_compute = old.defer_embedding_wgrad_compute
        comm.wgrad_deferral_limit = old.wgrad_deferral_limit
    comm.overlap_param_gather_with_optimizer_step = intent.param_gather_with_optimizer_step
    cfg.comm_overlap = comm
    _moe_overlap(cfg, intent)
    _dp_overlap(cfg, intent)
    _precision(cfg)
    return cfg


def _tp_overlap(cfg, intent: OverlapIntent, gpu: str):
    """A fresh CommOverlapConfig with tensor-parallel userbuffer overlap wherever TP>1 and the recipe does not keep
    it off: the recipe's preset, the one presets.select picks for this shape and GPU, or TE's defaults (opt-in)."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    if cfg.model.tensor_model_parallel_size < 2:
        return CommOverlapConfig(tp_comm_overlap=False)  # no TP collectives to overlap
    cfg.model.sequence_parallel = True  # TP overlap requires SP; Bridge drops TP overlap without it
    if intent.why_off(Overlap.TP):
        return CommOverlapConfig(tp_comm_overlap=False)
    if intent.tp_preset == presets.DEFAULT_TP_CONFIG:
        return CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=None)
    name = intent.tp_preset or presets.select(presets.key_of(cfg, gpu))
    return CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=presets.preset_object(name))


def _dp_overlap(cfg, intent: OverlapIntent) -> None:
    """DP overlap lives in Megatron DDP + the distributed optimizer; Bridge switches it on when DP>1."""
    pp = cfg.model.pipeline_model_parallel_size
    vpp = cfg.model.virtual_pipeline_model_parallel_size or 1
    cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = True
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = True
    cfg.ddp.align_param_gather = pp > 1 and vpp > 1
    if intent.why_off(Overlap.RS):  # Bridge's setup would switch it back on for DP>1 unless comm says no
        cfg.ddp.overlap_grad_reduce = cfg.comm_overlap.overlap_grad_reduce = False


def _precision(cfg) -> None:
    """Precision knobs go through cfg.mixed_precision: its setup() overwrites the ddp/optimizer copies."""
    mp = cfg.mixed_precision
    mp.grad_reduce_in_fp32 = False  # BF16 reduce-scatter halves DP traffic (NVIDIA's perf recipes do the same)
    mp.fp8_param_gather = bool(mp.fp8)  # gather FP8 params: half the all-gather bytes of BF16
    cfg.ddp.grad_reduce_in_fp32 = mp.grad_reduce_in_fp32


def is_moe(model) -> bool:
    return bool(getattr(model, "num_moe_experts", None))


def _moe_overlap(cfg, intent: OverlapIntent) -> None:
    """EP all-to-all overlap (and delayed expert wgrad) wherever the layout allows it and the recipe does not keep it
    off; shared-expert overlap cannot run beside it (Bridge asserts), so EP overlap switches it off."""
    m, comm = cfg.model, cfg.comm_overlap
    if not is_moe(m):
        return
    on = (m.expert_model_parallel_size or 1) > 1 and not intent.why_off(Overlap.EP)
    comm.overlap_moe_expert_parallel_comm = on
    comm.delay_wgrad_compute = bool(on and intent.delay_wgrad)
    if on:
        m.moe_shared_expert_overlap = False


@contextlib.contextmanager
def te_flag(available: bool, version: str | None = None):
    """Bridge gates TP overlap on its module-level `HAVE_TE`, and delay_wgrad on `is_te_min_version`, both probed on
    *this* machine. For the resolve we need the *target's* answers, so set them for the duration and restore them
    after. This is the only place we touch them. An unknown target version counts as new enough (the audit says so)."""
    from megatron.bridge.training import comm_overlap as co
    from packaging.version import Version

    def te_min(want, check_equality=True):
        if not available:
            return False
        if version is None:
            return True
        return Version(version) >= Version(want) if check_equality else Version(version) > Version(want)

    saved = co.HAVE_TE, co.is_te_min_version
    co.HAVE_TE, co.is_te_min_version = available, te_min
    try:
        yield
    finally:
        co.HAVE_TE, co.is_te_min_version = saved


def resolve(cfg, target: Target) -> Resolved:
    """Effective overlap state for `target`, computed by Bridge's own setup code on copies of `cfg`."""
    dp = data_parallel_size(cfg, target.world_size)
    model, ddp, opt = copy.deepcopy(cfg.model), copy.deepcopy(cfg.ddp), copy.deepcopy(cfg.optimizer)
    comm = copy.deepcopy(cfg.comm_overlap)
    cap, asserted = logging.handlers.BufferingHandler(capacity=sys.maxsize), []
    cap.setLevel(logging.WARNING)
    root = logging.getLogger()
    # Bridge reports drops with root-logger warnings. Route them to the audit only (not to stderr) for the resolve.
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers, root.level = [cap], logging.WARNING
    try:
        if (mp := cfg.mixed_precision) is not None and not isinstance(mp, str):
            mp = copy.deepcopy(mp)
            mp.finalize()
            mp.setup(model, opt, ddp)
        if comm is not None:
            comm.data_parallel_size = dp
            with te_flag(target.te_available, target.te_version):
                comm.finalize()
                saved = copy.deepcopy((model, opt, ddp))
                try:
                    comm.setup(model, opt, ddp)
                except AssertionError as exc:
                    # Bridge's MoE overlap prerequisites are bare asserts: record the message and resolve the rest
                    # of the stack without the EP overlap (the audit reports each one with its fix).
                    asserted = [" ".join(str(exc).split())]
                    for live, before in zip((model, opt, ddp), saved, strict=True):
                        live.__dict__.update(before.__dict__)
                    comm.user_comm_overlap_cfg.overlap_moe_expert_parallel_comm = False
                    comm.user_comm_overlap_cfg.delay_wgrad_compute = False
                    comm.setup(model, opt, ddp)
    finally:
        root.handlers, root.level = saved_handlers, saved_level
    return Resolved(model, ddp, opt, comm, dp, [r.getMessage() for r in cap.buffer], asserted)
