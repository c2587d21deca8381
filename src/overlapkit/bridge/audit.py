"""Audit: one row per overlap (on / off / n/a, with the reason) and loud findings for anything that would degrade.

One function per overlap group, as Bridge's comm_overlap.py decides one thing per method. Every error message is
one line that names the fix. Rows and JSON keys are stable: the nightly and the launch path read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from overlapkit.bridge import moe, overrides, presets
from overlapkit.bridge.overlap import Resolved
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import NA, OFF, ON, Overlap, OverlapIntent
from overlapkit.spec.shape import ModelShape, dtype_of
from overlapkit.spec.topology import Target

# A bucket of >= 2**30 *parameters* is 2-4 GiB of gradients: no chunk of our models warrants it, while 1 GiB written
# as a byte count is a common slip (Bridge's and Megatron's bucket_size counts parameters, not bytes).
BYTES_LIKE_BUCKET = 2**30
# Megatron DDP's own default when bucket_size is None (megatron/core/distributed/distributed_data_parallel.py).
MCORE_DEFAULT_BUCKET = "max(40M, 1M·DP) params (Megatron DDP default)"


@dataclass
class Row:
    name: str
    state: str
    detail: str


@dataclass
class AuditReport:
    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def codes(self, level: str | None = None) -> set[str]:
        return {f.code for f in self.findings if level is None or f.level == level}

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "rows": {r.name: {"state": r.state, "detail": r.detail} for r in self.rows},
            "errors": [f._asdict() for f in self.errors],
            "warnings": [f._asdict() for f in self.warnings],
        }


def split_violations(
    *, seq, layers, units, tp, pp, vpp, cp, dp, mbs, gbs, heads=None, groups=None, ffn=None
) -> list[tuple[str, str]]:
    """(code, message) for each divisibility rule a parallel split breaks, on bare numbers. One source for the audit
    (on a built config, adding its fixes) and for layout_search (thousands of candidate splits, no configs).
    `units`: transformer layers plus the embedding/loss that Bridge accounts in the pipeline split; None when an
    explicit pipeline layout replaces the even split."""
    out, stages = [], pp * (vpp or 1)
    if tp > 1 and seq % tp:
        out.append(("seq_not_divisible_tp", f"seq {seq} is not divisible by TP{tp}"))
    if cp > 1 and seq % (2 * cp):
        out.append(("seq_not_divisible_cp", f"seq {seq} is not divisible by 2·CP={2 * cp}"))
    if pp > 1 and units is not None and units % stages:
        out.append(
            ("layers_not_divisible", f"layers {layers} (+embedding/loss: {units}) are not divisible by PP·VPP={stages}")
        )
    if gbs % (dp * mbs):
        out.append(("gbs_not_divisible", f"GBS {gbs} is not divisible by DP·MBS={dp}·{mbs}"))
    # Megatron Core's TransformerConfig and its tensor-parallel linear layers split these by TP (core/utils.divide).
    for code, what, n in (
        ("heads_not_divisible_tp", "attention heads", heads),
        ("groups_not_divisible_tp", "query groups", groups),
        ("ffn_not_divisible_tp", "FFN hidden size", ffn),
    ):
        if n and n % tp:
            out.append((code, f"{what} {n} are not divisible by TP{tp}"))
    if heads and groups and heads % groups:
        out.append(
            ("heads_not_divisible_groups", f"attention heads {heads} are not divisible by query groups {groups}")
        )
    return out


# What the audit adds to each split rule: why it matters, and the fix.
SPLIT_FIXES = {
    "seq_not_divisible_tp": "sequence parallel and TE need it",
    "seq_not_divisible_cp": "CP load balancing splits each sequence in 2·CP chunks",
    "layers_not_divisible": "change VPP/PP or give model.pipeline_model_parallel_layout",
    "gbs_not_divisible": "use a multiple of {dp_mbs}",
    "heads_not_divisible_tp": "each TP rank holds whole heads: change TP or the head count",
    "groups_not_divisible_tp": "each TP rank holds whole KV groups: change TP or model.num_query_groups",
    "ffn_not_divisible_tp": "the MLP is split by TP: change TP or model.ffn_hidden_size",
    "heads_not_divisible_groups": "grouped-query attention shares each KV group among whole heads",
}


@dataclass
class _Audit:
    """One audit in progress: the config as written, Bridge's resolved state, and the report being filled."""

    cfg: object
    target: Target
    res: Resolved
    intent: OverlapIntent
    rep: AuditReport = field(default_factory=AuditReport)

    def row(self, name: str, state: str, detail: str) -> None:
        self.rep.rows.append(Row(str(name), state, detail))

    def err(self, code: str, msg: str, fix: str | None = None) -> None:
        self.rep.findings.append(Finding("error", code, msg, fix))

    def warn(self, code: str, msg: str) -> None:
        self.rep.findings.append(Finding("warning", code, msg))

    @property
    def layout(self) -> tuple[int, int, int, int | None, int]:
        m = self.cfg.model
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size or 1
        return tp, pp, cp, m.virtual_pipeline_model_parallel_size, self.res.data_parallel_size


def audit(cfg, target: Target, resolved: Resolved, intent: OverlapIntent | None = None) -> AuditReport:
    """Audit recipe `cfg` (as written, with the recipe's `intent`) against Bridge's `resolved` state for `target`."""
    a = _Audit(cfg, target, resolved, intent or OverlapIntent())
    for check in (_tp_overlap, _split, _p2p_overlap, _dp_overlap, _precision, _moe):
        check(a)
    return a.rep


def _moe(a: _Audit) -> None:
    """Expert parallelism (bridge/moe.py): EP a2a overlap, delayed wgrad, shared experts, dispatcher, expert-DP."""
    rows, findings = moe.rows_and_findings(a.cfg, a.target, a.res, a.intent)
    a.rep.rows += [Row(str(name), state, detail) for name, state, detail in rows]
    a.rep.findings += findings


def replaced_overrides(cfg, res: Resolved, changes) -> AuditReport:
    """An override that Bridge's setup replaced is an error naming the field that wins, never "applied"."""
    rep = AuditReport()
    live = {"model": res.model, "ddp": res.ddp, "optimizer": res.optimizer, "comm_overlap": res.comm}
    last = {key: new for key, _, new in changes}  # a key set twice: the later value is the override
    for key, new in last.items():
        section, _, leaf = key.partition(".")
        obj = live.get(section)
        if obj is None or "." in leaf or not hasattr(obj, leaf) or (got := getattr(obj, leaf)) == new:
            continue
        # The field that decides `section.leaf`: Bridge's comm-overlap setup writes its own defaults, overridden by
        # any comm_overlap field the user set, over ddp/model/optimizer (CommOverlapConfig._override_user_cfgs), and
        # its mixed-precision setup does the same from cfg.mixed_precision.
        setters = [n for n in ("comm_overlap", "mixed_precision") if n != section and is_dataclass(getattr(cfg, n))]
        winner = next((f"{n}.{leaf}" for n in setters if leaf in {f.name for f in fields(getattr(cfg, n))}), None)
        value = new
        if leaf == "bucket_size" and isinstance(new, int):
            chunk, width = _chunk_params(cfg), _grad_dtype(res.ddp)[1]
            value = sane_bucket(new, chunk, width) if new >= min(chunk, BYTES_LIKE_BUCKET) else new
        fix = f"{winner}={overrides.to_raw(value)}" if winner else None
        where = f"{winner} wins; set {fix} instead" if winner else "Bridge decides it for this layout"
        replaced = f"is not applied: Bridge's setup replaces it with {overrides.to_raw(got)}"
        msg = f"{key}={overrides.to_raw(new)} {replaced}; {where}"
        rep.findings.append(Finding("error", "override_replaced", msg, fix))
    return rep


def _chunk_params(cfg) -> int:
    """Parameters of one model chunk on one TP rank (what one DDP grad buffer holds): the bucket rules' yardstick."""
    m = cfg.model
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    return ModelShape.of(cfg).chunk_params(tp, pp, vpp)


def _tp_overlap(a: _Audit) -> None:
    """TP comm overlap (userbuffers): requested, kept by Bridge, and with a userbuffers config that is a Bridge
    preset matching the model."""
    cfg, tp = a.cfg, a.layout[0]
    requested = bool(cfg.comm_overlap is not None and cfg.comm_overlap.tp_comm_overlap)
    if tp < 2:
        a.row(Overlap.TP, NA, f"TP={tp} by design of this layout: no tensor-parallel collectives to overlap")
        if requested:
            how = f"model.tensor_model_parallel_size>=2 or {Overlap.TP.field}=false"
            a.err("tp_overlap_dropped", f"TP overlap requested but Bridge drops it: TP={tp} < 2; set {how}")
        return
    if not requested and (why := a.intent.why_off(Overlap.TP)):
        a.row(Overlap.TP, OFF, f"kept off: {why}")
        return
    if not requested:
        a.row(Overlap.TP, OFF, f"TP={tp} but {Overlap.TP.field} is off")
        msg = f"TP={tp} without TP comm overlap: set {Overlap.TP.field}=true"
        a.err("tp_overlap_off", msg, f"{Overlap.TP.field}=true")
        return
    if not a.res.model.tp_comm_overlap:
        if not cfg.model.sequence_parallel:
            why, fix = "sequence_parallel is off", "set model.sequence_parallel=true"
        elif not a.target.te_available:
            why, fix = "Transformer Engine is missing on the target", "launch in a container with TE (NeMo image)"
        else:
            why, fix = "; ".join(a.res.bridge_warnings) or "Bridge disabled it", "see Bridge's warning"
        a.row(Overlap.TP, OFF, f"dropped by Bridge: {why}")
        sets = "model.sequence_parallel=true" if not cfg.model.sequence_parallel else None
        a.err("tp_overlap_dropped", f"TP overlap requested but Bridge drops it: {why}; {fix}", sets)
        return
    ub = cfg.comm_overlap.tp_comm_overlap_cfg  # on: its userbuffers config, a preset that fits the model?
    name, key = presets.name_of(ub), presets.key_of(cfg, a.target.gpu)
    if ub is None:
        a.row(Overlap.TP, ON, f"TP={tp}, SP on; TE's default userbuffers config")
        if a.intent.tp_preset == presets.DEFAULT_TP_CONFIG:
            a.warn("tp_default_config", "TP overlap uses TE's default userbuffers config (explicit opt-in)")
        else:
            msg = "TP overlap has no userbuffers preset, so TE would silently use its default"
            how = f"use one of {', '.join(presets.nearest(key))} or opt in with tp_preset='default'"
            a.err("tp_default_config", f"{msg}; {how}")
        return
    if name is None:
        a.row(Overlap.TP, ON, f"TP={tp}, SP on; custom userbuffers config")
        a.warn("tp_custom_config", "TP overlap uses a custom userbuffers config: its shape cannot be checked")
        return
    a.row(Overlap.TP, ON, f"TP={tp}, SP on, TE on target; preset {name}")
    hard, soft = presets.mismatches(presets.exported_presets()[name], key)
    if hard:
        msg = f"userbuffers preset {name} contradicts the model ({', '.join(hard)})"
        a.err("preset_mismatch", f"{msg}; use {', '.join(presets.nearest(key, 1))}")
    elif soft:
        msg = f"userbuffers preset {name} was tuned for another shape ({', '.join(soft)}): buffers fit"
        a.warn("preset_tuning_mismatch", f"{msg}, SM counts may not; nearest: {presets.nearest(key, 1)[0]}")


def _split(a: _Audit) -> None:
    """Divisibility of the parallel split (the rules layout_search shares through split_violations)."""
    m, (tp, pp, cp, vpp, dp) = a.cfg.model, a.layout
    units = None if m.pipeline_model_parallel_layout is not None else ModelShape.of(a.cfg).pipeline_units
    mbs, gbs = a.cfg.train.micro_batch_size, a.cfg.train.global_batch_size
    split = dict(
        seq=m.seq_length, layers=m.num_layers, units=units, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, mbs=mbs, gbs=gbs
    )
    for code, msg in split_violations(
        **split, heads=m.num_attention_heads, groups=m.num_query_groups, ffn=m.ffn_hidden_size
    ):
        fix = f"train.global_batch_size={-(-gbs // (dp * mbs)) * dp * mbs}" if code == "gbs_not_divisible" else None
        a.err(code, f"{msg}: {SPLIT_FIXES[code].format(dp_mbs=dp * mbs)}", fix)


def _p2p_overlap(a: _Audit) -> None:
    """Pipeline p2p overlap: Bridge selects it only with PP>1 and VPP>1."""
    _, pp, _, vpp, _ = a.layout
    if pp == 1:
        a.row(Overlap.P2P, NA, "PP=1: no pipeline p2p")
        if vpp and vpp > 1:
            fix = "model.virtual_pipeline_model_parallel_size=null"
            a.err("vpp_without_pp", f"VPP={vpp} set with PP=1: set {fix}", fix)
    elif a.res.model.overlap_p2p_comm:
        a.row(Overlap.P2P, ON, f"PP={pp} × VPP={vpp}: interleaved schedule overlaps p2p")
    elif (not vpp or vpp == 1) and (kept := a.intent.why_off(Overlap.P2P)):
        a.row(Overlap.P2P, OFF, f"PP={pp} without VPP, kept off: {kept}")
    elif not vpp or vpp == 1:
        why = f"PP={pp} without VPP: Bridge selects batch_p2p_comm (no overlap)"
        a.row(Overlap.P2P, OFF, why)
        a.err("p2p_overlap_off", f"{why}; set model.virtual_pipeline_model_parallel_size>1")  # no one value to SET
    else:
        why, fix = f"{Overlap.P2P.field}=false overrides Bridge", f"{Overlap.P2P.field}=true"
        a.row(Overlap.P2P, OFF, why)
        a.err("p2p_overlap_off", f"{why}; set {fix}", fix)


def _grad_dtype(rddp) -> tuple[str, int]:
    return ("fp32", 4) if rddp.grad_reduce_in_fp32 else ("bf16", 2)


def _dp_overlap(a: _Audit) -> None:
    """Data-parallel grad reduce-scatter / param all-gather overlap (distributed optimizer); the bucket size, which
    counts parameters (a byte count by mistake, or one bucket per chunk, leaves nothing to overlap); and the opt-in
    param-gather overlap with the optimizer step, which Bridge leaves off because of checkpointing."""
    rddp, (_, _, _, vpp, dp) = a.res.ddp, a.layout
    dist_opt, bucket, (grad_dtype, width) = bool(rddp.use_distributed_optimizer), rddp.bucket_size, _grad_dtype(rddp)
    if dp == 1:
        for name in (Overlap.RS, Overlap.AG, "align_param_gather", "bucket_size"):
            a.row(name, NA, "DP=1: no data-parallel collectives")
        a.warn("dp1", "DP=1 on this layout: grad-reduce and param-gather overlap are n/a (add nodes for DP>1)")
    else:
        if not dist_opt:
            fix, msg = "ddp.use_distributed_optimizer=true", f"DP={dp} without the distributed optimizer: Bridge skips"
            msg += " its DP overlap setup and param-gather overlap cannot run"
            a.err("no_distributed_optimizer", f"{msg}; set {fix}", fix)
        for o, what in ((Overlap.RS, "grad reduce-scatter"), (Overlap.AG, "param all-gather")):
            if getattr(rddp, o) and dist_opt:
                a.row(o, ON, f"DP={dp}: {what} overlapped with backward/forward")
            elif dist_opt and (why := a.intent.why_off(o)):
                a.row(o, OFF, f"kept off: {why}")
            elif dist_opt:
                a.row(o, OFF, f"DP={dp} but {o.field}=false")
                a.err(f"{o}_off", f"DP={dp} without {what} overlap; set {o.field}=true", f"{o.field}=true")
            else:
                a.row(o, OFF, f"DP={dp} but no distributed optimizer")
        if rddp.align_param_gather:
            a.row("align_param_gather", ON, "VPP>1: param all-gathers aligned across chunks")
        else:
            a.row("align_param_gather", NA if not (vpp and vpp > 1) else OFF, "needs PP>1 and VPP>1")
        if bucket is None:
            a.row("bucket_size", ON, MCORE_DEFAULT_BUCKET)
        else:
            mb, chunk = bucket * width / 2**20, _chunk_params(a.cfg)
            a.row("bucket_size", ON, f"{bucket:,} params = {mb:,.0f} MB at {grad_dtype}")
            # The field that decides the bucket: Bridge's comm-overlap setup copies comm_overlap.bucket_size over
            # ddp.bucket_size whenever it is set (training/comm_overlap.py, CommOverlapConfig.setup).
            comm_bucket = getattr(a.cfg.comm_overlap, "bucket_size", None)
            field = "comm_overlap.bucket_size" if comm_bucket is not None else "ddp.bucket_size"
            good = sane_bucket(bucket, chunk, width)
            if bucket >= BYTES_LIKE_BUCKET:
                why = f"looks like bytes: it counts parameters ({mb:,.0f} MB of {grad_dtype} grads); use e.g."
                a.err("bucket_size_bytes", f"{field}={bucket:,} {why} {field}={good}", f"{field}={good}")
            elif bucket >= chunk:
                why = f"params ≥ a model chunk ({chunk:,} params): one bucket, so grad reduce cannot overlap"
                why += "; use ≤ chunk/4"
                a.err("bucket_size_single", f"{field}={bucket:,} {why}, e.g. {field}={good}", f"{field}={good}")
    on = bool(getattr(a.res.optimizer, "overlap_param_gather_with_optimizer_step", False))
    detail = "opt-in" if on else "off by default (Bridge: checkpointing issue)"
    a.row("overlap_param_gather_with_optimizer_step", ON if on else OFF, detail)
    from megatron.bridge.utils.cuda_graph import is_full_iteration_cuda_graph

    ckpt = a.cfg.checkpoint
    if on and is_full_iteration_cuda_graph(a.res.model):
        # Megatron-Bridge #5788: the gather is dispatched from the previous optimizer step, outside the captured
        # iteration; the captured forward's wait on it makes the capture fail. Bridge's own predicate decides.
        fix, msg = "overlap.param_gather_with_optimizer_step=false", "overlap_param_gather_with_optimizer_step with a"
        msg += " full-iteration CUDA graph: the capture fails on the gather started outside it (Megatron-Bridge #5788)"
        a.err("opt_step_with_full_iteration_graph", f"{msg}; set {fix}", fix)
    if on and ckpt.save and ckpt.save_interval:
        msg = f"overlap_param_gather_with_optimizer_step with checkpoint saving on (every {ckpt.save_interval} iters)"
        a.warn("opt_step_with_checkpointing", f"{msg}: Bridge disables it by default because of checkpointing")


def sane_bucket(bucket: int, chunk: int, width: int) -> int:
    """A bucket that passes both rules: the byte count read as bytes, capped at a quarter chunk, whole millions."""
    want = min(bucket // width if bucket >= BYTES_LIKE_BUCKET else bucket, chunk // 4, BYTES_LIKE_BUCKET - 1)
    return max(1, want // 1_000_000 * 1_000_000 if want >= 1_000_000 else want)


def _precision(a: _Audit) -> None:
    """grad_reduce_in_fp32 and fp8_param_gather, which belong on cfg.mixed_precision (its setup overwrites ddp)."""
    cfg, rddp, dp = a.cfg, a.res.ddp, a.layout[4]
    mp = cfg.mixed_precision if cfg.mixed_precision is not None and not isinstance(cfg.mixed_precision, str) else None
    a.row(
        "grad_reduce_in_fp32",
        ON if rddp.grad_reduce_in_fp32 else OFF,
        f"gradients reduced in {_grad_dtype(rddp)[0]} (set via mixed_precision)",
    )
    if mp is not None and cfg.ddp.grad_reduce_in_fp32 != mp.grad_reduce_in_fp32:
        msg = f"ddp.grad_reduce_in_fp32={cfg.ddp.grad_reduce_in_fp32} contradicts mixed_precision.grad_reduce_in_fp32="
        msg += f"{mp.grad_reduce_in_fp32}, which overwrites it; set it on mixed_precision"
        fix = f"mixed_precision.grad_reduce_in_fp32={str(cfg.ddp.grad_reduce_in_fp32).lower()}"
        a.err("grad_reduce_fp32_conflict", msg, fix)
    fp8_pg = bool(mp is not None and mp.fp8_param_gather)
    if dtype_of(cfg) == "bf16":
        a.row(Overlap.FP8_AG, NA if not fp8_pg else ON, "BF16 run")
        if fp8_pg:
            fix = f"{Overlap.FP8_AG.field}=false"
            a.err("fp8_param_gather_bf16", f"fp8_param_gather on a BF16 run: set {fix}", fix)
        return
    a.row(Overlap.FP8_AG, ON if fp8_pg else OFF, "FP8 params all-gathered in FP8")
    if fp8_pg and (not rddp.use_distributed_optimizer or (dp > 1 and not rddp.overlap_param_gather)):
        how = "ddp.use_distributed_optimizer=true and comm_overlap.overlap_param_gather=true"
        msg = "fp8_param_gather needs the distributed optimizer with param-gather overlap"
        a.err("fp8_param_gather_without_dp_overlap", f"{msg}: set {how}")
