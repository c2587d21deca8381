"""Audit: one row per overlap (on / off / n/a, with the reason) and loud findings for anything that would degrade.

Every error message is one line that names the fix. Rows and JSON keys are stable: the nightly and the launch path
read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from overlapkit import presets
from overlapkit.overlap import OverlapIntent, Resolved, Target, chunk_params, dtype_of, intent_of, shape_of

ON, OFF, NA = "on", "off", "n/a"
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
class Finding:
    level: str  # "error" | "warning"
    code: str
    message: str


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
            "errors": [asdict(f) for f in self.errors],
            "warnings": [asdict(f) for f in self.warnings],
        }


def split_violations(*, seq, layers, units, tp, pp, vpp, cp, dp, mbs, gbs) -> list[tuple[str, str]]:
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
        out.append(("layers_not_divisible", f"layers {layers} (+embedding/loss: {units}) are not divisible by "
                    f"PP·VPP={stages}"))  # fmt: skip
    if gbs % (dp * mbs):
        out.append(("gbs_not_divisible", f"GBS {gbs} is not divisible by DP·MBS={dp}·{mbs}"))
    return out


# What the audit adds to each split rule: why it matters, and the fix.
SPLIT_FIXES = {
    "seq_not_divisible_tp": "sequence parallel and TE need it",
    "seq_not_divisible_cp": "CP load balancing splits each sequence in 2·CP chunks",
    "layers_not_divisible": "change VPP/PP or give model.pipeline_model_parallel_layout",
    "gbs_not_divisible": "use a multiple of {dp_mbs}",
}


def audit(cfg, target: Target, resolved: Resolved, intent: OverlapIntent | None = None, env=None) -> AuditReport:
    """Audit recipe `cfg` (as written) against Bridge's `resolved` state for `target`; `env` adds launch-time rules."""
    intent = intent or intent_of(cfg)
    rep = AuditReport()
    err = lambda code, msg: rep.findings.append(Finding("error", code, msg))  # noqa: E731
    warn = lambda code, msg: rep.findings.append(Finding("warning", code, msg))  # noqa: E731
    m, rm, rddp, dp = cfg.model, resolved.model, resolved.ddp, resolved.data_parallel_size
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size or 1
    vpp = m.virtual_pipeline_model_parallel_size
    seq, mbs, gbs = m.seq_length, cfg.train.micro_batch_size, cfg.train.global_batch_size
    requested_tp = bool(cfg.comm_overlap is not None and cfg.comm_overlap.tp_comm_overlap)

    # --- TP comm overlap (userbuffers) -------------------------------------------------------------------------
    if tp < 2:
        rep.rows.append(
            Row("tp_comm_overlap", NA, f"TP={tp} by design of this layout: no tensor-parallel collectives to overlap")
        )
        if requested_tp:
            err(
                "tp_overlap_dropped",
                f"TP overlap requested but Bridge drops it: TP={tp} < 2; set "
                "model.tensor_model_parallel_size>=2 or comm_overlap.tp_comm_overlap=false",
            )
    elif not requested_tp:
        rep.rows.append(Row("tp_comm_overlap", OFF, f"TP={tp} but comm_overlap.tp_comm_overlap is off"))
        err("tp_overlap_off", f"TP={tp} without TP comm overlap: set comm_overlap.tp_comm_overlap=true")
    elif not rm.tp_comm_overlap:
        if not m.sequence_parallel:
            why, fix = "sequence_parallel is off", "set model.sequence_parallel=true"
        elif not target.te_available:
            why, fix = "Transformer Engine is missing on the target", "launch in a container with TE (NeMo image)"
        else:
            why, fix = "; ".join(resolved.bridge_warnings) or "Bridge disabled it", "see Bridge's warning"
        rep.rows.append(Row("tp_comm_overlap", OFF, f"dropped by Bridge: {why}"))
        err("tp_overlap_dropped", f"TP overlap requested but Bridge drops it: {why}; {fix}")
    else:
        name = presets.name_of(cfg.comm_overlap.tp_comm_overlap_cfg)
        shape = shape_of(cfg, target.gpu)
        if cfg.comm_overlap.tp_comm_overlap_cfg is None:
            rep.rows.append(Row("tp_comm_overlap", ON, f"TP={tp}, SP on; TE's default userbuffers config"))
            if intent.tp_preset == presets.DEFAULT_TP_CONFIG:
                warn("tp_default_config", "TP overlap uses TE's default userbuffers config (explicit opt-in)")
            else:
                err(
                    "tp_default_config",
                    "TP overlap has no userbuffers preset, so TE would silently use its default; "
                    f"use one of {', '.join(presets.nearest(shape))} or opt in with tp_preset='default'",
                )
        elif name is None:
            rep.rows.append(Row("tp_comm_overlap", ON, f"TP={tp}, SP on; custom userbuffers config"))
            warn("tp_custom_config", "TP overlap uses a custom userbuffers config: its shape cannot be checked")
        else:
            rep.rows.append(Row("tp_comm_overlap", ON, f"TP={tp}, SP on, TE on target; preset {name}"))
            hard, soft = presets.mismatches(presets.exported_presets()[name], shape)
            if hard:
                err(
                    "preset_mismatch",
                    f"userbuffers preset {name} contradicts the model ({', '.join(hard)}); "
                    f"use {', '.join(presets.nearest(shape, 1))}",
                )
            elif soft:
                warn(
                    "preset_tuning_mismatch",
                    f"userbuffers preset {name} was tuned for another shape "
                    f"({', '.join(soft)}): buffers fit, SM counts may not; nearest: {presets.nearest(shape, 1)[0]}",
                )
    units = None
    if m.pipeline_model_parallel_layout is None:
        units = m.num_layers + bool(m.account_for_embedding_in_pipeline_split)
        units += bool(m.account_for_loss_in_pipeline_split)
    split = dict(seq=seq, layers=m.num_layers, units=units, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, mbs=mbs, gbs=gbs)
    for code, msg in split_violations(**split):
        err(code, f"{msg}: {SPLIT_FIXES[code].format(dp_mbs=dp * mbs)}")

    # --- Pipeline p2p overlap ------------------------------------------------------------------------------------
    if pp == 1:
        rep.rows.append(Row("overlap_p2p_comm", NA, "PP=1: no pipeline p2p"))
        if vpp and vpp > 1:
            err("vpp_without_pp", f"VPP={vpp} set with PP=1: set model.virtual_pipeline_model_parallel_size=null")
    elif rm.overlap_p2p_comm:
        rep.rows.append(Row("overlap_p2p_comm", ON, f"PP={pp} × VPP={vpp}: interleaved schedule overlaps p2p"))
    else:
        if not vpp or vpp == 1:
            why = f"PP={pp} without VPP: Bridge selects batch_p2p_comm (no overlap)"
            fix = "set model.virtual_pipeline_model_parallel_size>1"
        else:
            why, fix = "comm_overlap.overlap_p2p_comm=false overrides Bridge", "set comm_overlap.overlap_p2p_comm=true"
        rep.rows.append(Row("overlap_p2p_comm", OFF, why))
        err("p2p_overlap_off", f"{why}; {fix}")

    # --- Data-parallel overlap (distributed optimizer) ---------------------------------------------------------
    dist_opt = bool(rddp.use_distributed_optimizer)
    grad_dtype = "fp32" if rddp.grad_reduce_in_fp32 else "bf16"
    if dp == 1:
        for name in ("overlap_grad_reduce", "overlap_param_gather", "align_param_gather", "bucket_size"):
            rep.rows.append(Row(name, NA, "DP=1: no data-parallel collectives"))
        warn("dp1", "DP=1 on this layout: grad-reduce and param-gather overlap are n/a (add nodes for DP>1)")
    else:
        if not dist_opt:
            err(
                "no_distributed_optimizer",
                f"DP={dp} without the distributed optimizer: Bridge skips its DP overlap "
                "setup and param-gather overlap cannot run; set ddp.use_distributed_optimizer=true",
            )
        pairs = (("overlap_grad_reduce", "grad reduce-scatter"), ("overlap_param_gather", "param all-gather"))
        for name, what in pairs:
            if getattr(rddp, name) and dist_opt:
                rep.rows.append(Row(name, ON, f"DP={dp}: {what} overlapped with backward/forward"))
            elif dist_opt:
                rep.rows.append(Row(name, OFF, f"DP={dp} but comm_overlap.{name}=false"))
                err(f"{name}_off", f"DP={dp} without {what} overlap; set comm_overlap.{name}=true")
            else:
                rep.rows.append(Row(name, OFF, f"DP={dp} but no distributed optimizer"))
        if rddp.align_param_gather:
            rep.rows.append(Row("align_param_gather", ON, "VPP>1: param all-gathers aligned across chunks"))
        else:
            rep.rows.append(Row("align_param_gather", NA if not (vpp and vpp > 1) else OFF, "needs PP>1 and VPP>1"))
        bucket = rddp.bucket_size
        if bucket is None:
            rep.rows.append(Row("bucket_size", ON, MCORE_DEFAULT_BUCKET))
        else:
            mb = bucket * (4 if grad_dtype == "fp32" else 2) / 2**20
            rep.rows.append(Row("bucket_size", ON, f"{bucket:,} params = {mb:,.0f} MB at {grad_dtype}"))
            chunk = chunk_params(m)
            if bucket >= BYTES_LIKE_BUCKET:
                err(
                    "bucket_size_bytes",
                    f"ddp.bucket_size={bucket:,} looks like bytes: it counts parameters "
                    f"({mb:,.0f} MB of {grad_dtype} grads); use e.g. {bucket // (4 if grad_dtype == 'fp32' else 2):,}",
                )
            elif bucket >= chunk:
                err(
                    "bucket_size_single",
                    f"ddp.bucket_size={bucket:,} params ≥ a model chunk ({chunk:,} params): "
                    "one bucket, so grad reduce cannot overlap; use ≤ chunk/4",
                )
    opt_step = bool(getattr(resolved.optimizer, "overlap_param_gather_with_optimizer_step", False))
    rep.rows.append(
        Row(
            "overlap_param_gather_with_optimizer_step",
            ON if opt_step else OFF,
            "opt-in" if opt_step else "off by default (Bridge: checkpointing issue)",
        )
    )
    if opt_step and cfg.checkpoint.save and cfg.checkpoint.save_interval:
        warn(
            "opt_step_with_checkpointing",
            "overlap_param_gather_with_optimizer_step with checkpoint saving on "
            f"(every {cfg.checkpoint.save_interval} iters): Bridge disables it by default because of checkpointing",
        )

    # --- Mixed-precision knobs ------------------------------------------------------------------------------------
    mp = cfg.mixed_precision
    rep.rows.append(
        Row(
            "grad_reduce_in_fp32",
            ON if rddp.grad_reduce_in_fp32 else OFF,
            f"gradients reduced in {grad_dtype} (set via mixed_precision)",
        )
    )
    if mp is not None and not isinstance(mp, str) and cfg.ddp.grad_reduce_in_fp32 != mp.grad_reduce_in_fp32:
        err(
            "grad_reduce_fp32_conflict",
            f"ddp.grad_reduce_in_fp32={cfg.ddp.grad_reduce_in_fp32} contradicts "
            f"mixed_precision.grad_reduce_in_fp32={mp.grad_reduce_in_fp32}, which overwrites it; "
            "set it on mixed_precision",
        )
    fp8_pg = bool(mp is not None and not isinstance(mp, str) and mp.fp8_param_gather)
    if dtype_of(cfg) == "bf16":
        rep.rows.append(Row("fp8_param_gather", NA if not fp8_pg else ON, "BF16 run"))
        if fp8_pg:
            err("fp8_param_gather_bf16", "fp8_param_gather on a BF16 run: set mixed_precision.fp8_param_gather=false")
    else:
        rep.rows.append(Row("fp8_param_gather", ON if fp8_pg else OFF, "FP8 params all-gathered in FP8"))
        if fp8_pg and (not dist_opt or (dp > 1 and not rddp.overlap_param_gather)):
            err(
                "fp8_param_gather_without_dp_overlap",
                "fp8_param_gather needs the distributed optimizer with "
                "param-gather overlap: set ddp.use_distributed_optimizer=true and "
                "comm_overlap.overlap_param_gather=true",
            )

    if env is not None:
        _audit_env(rep, env, tp_overlap=bool(rm.tp_comm_overlap), tp=tp, cp=cp, fsdp=bool(cfg.ddp.use_megatron_fsdp))
    return rep


def _audit_env(rep: AuditReport, env, *, tp_overlap: bool, tp: int, cp: int, fsdp: bool) -> None:
    """Launch-time rules (values come from the env-var plugin's ledger)."""
    value = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    needs_one = tp_overlap or tp > 1 or cp > 1
    state = ON if value is not None else OFF
    rep.rows.append(Row("CUDA_DEVICE_MAX_CONNECTIONS", state, f"{value} (TP={tp}, CP={cp})"))
    if needs_one and str(value) != "1":
        rep.findings.append(
            Finding(
                "error",
                "cuda_max_connections",
                f"CUDA_DEVICE_MAX_CONNECTIONS={value} with "
                f"TP={tp}/CP={cp} overlap: must be 1 so compute and comm kernels keep their order",
            )
        )
    elif not needs_one and str(value) == "1":
        rep.findings.append(
            Finding(
                "error",
                "cuda_max_connections",
                "CUDA_DEVICE_MAX_CONNECTIONS=1 with TP=CP=1 "
                f"serialises DP overlap{' (and FSDP refuses it)' if fsdp else ''}: use 32",
            )
        )
