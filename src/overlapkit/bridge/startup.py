"""The stack's own start-up checks, run on CPU before the queue (issue 42).

When a job starts, Bridge's `pretrain()` runs `runtime_config_update(cfg)` (megatron/bridge/training/config.py):
mixed-precision and comm-overlap setup, then `ConfigContainer.validate()`, which finalizes every sub-config (Core's
DDP, optimizer and TransformerConfig post-inits among them). The plan runs that function on a copy of its config for
the planned world size, then the NCCL EP dispatcher manager's config-only preconditions where the recipe uses that
backend. Nothing here restates a rule: what the stack raises is an error finding, what it warns (`warnings` or
logging) a warning, and a warning that says a claimed overlap is lost turns that overlap's row off (an error).

Mocked for the duration of the check only, because a CPU machine has none of them:
- the target's Transformer Engine: its version (Core's `get_te_version`, which every `is_te_min_version` gate reads:
  the target's container's, else uv.lock's), and the TE symbols Core's config checks look up (`FusedAdam`'s
  arguments, the fused RoPE and permutation kernels, TE's NCCL EP entry points);
- the GPU: `torch.cuda.get_device_capability`/`get_device_properties` answer the target's (sm90 for H100/H200);
- the process: WORLD_SIZE (Bridge's `get_world_size_safe`), with no process group, as in the job before
  `initialize_megatron`; os.environ is restored after (env_vars use setdefault).
What cannot run on CPU: the process-group set-up, the dispatcher's buffers, TE's kernels (docs/plan.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import logging.handlers
import os
import re
import sys
import traceback
import types
import warnings
from functools import cache

from overlapkit.bridge import stack, stackenv, te_stub
from overlapkit.bridge.audit import Row
from overlapkit.bridge.overlap import Resolved, te_flag
from overlapkit.errors import one_line
from overlapkit.sizing import hardware
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import OFF, ON
from overlapkit.spec.topology import Target

# The config field the stack's messages name for an audit row, where the row has another name.
STACK_NAME = {"ep_a2a_overlap": "overlap_moe_expert_parallel_comm"}
# A warning that names an overlap's field and says one of these has lost it (Core's ncclep warning: "serializes the
# 1F1B overlap (correct, but loses the overlap benefit)").
LOST = re.compile(
    r"serializ|loses? the overlap|overlap (is |will be )?(lost|disabled|ignored)|disabl|not overlap|no overlap|"
    r"ignored|has no effect|falls? back|turn(ed|ing|s)? off|dropp",
    re.IGNORECASE,
)
# `name=value` in a stack message: a field and the value the message asks for (quotes, True/False as Python).
ASSIGNMENT = re.compile(
    r"\b((?:[a-z_][a-z0-9_]*\.)?[a-z_][a-z0-9_]*)\s*=\s*('[^']*'|\"[^\"]*\"|True|False|None|-?\w[\w.]*)"
)
GPU_CAPABILITY = {"h100": (9, 0), "h200": (9, 0)}  # Hopper: sm90 (NVIDIA's CUDA compute-capability table)
FUSIONS = "megatron.bridge.utils.fusions"  # the module of Bridge's build-time probes


@dataclasses.dataclass(frozen=True)
class Said:
    """What the stack said while starting the config: `raised` (where, message) or None, and its warnings."""

    raised: tuple[str, str] | None
    warned: tuple[tuple[str, str], ...]


def check(cfg, target: Target, res: Resolved) -> Said:
    """Run Bridge's start-up and the NCCL EP manager's preconditions on a copy of `cfg` for `target`, under the mocks.
    Where Bridge's setup already asserted on an EP-overlap prerequisite (the audit reports it), the copy starts
    without the EP overlap, as the resolve does, so the rest of the config is still checked."""
    from megatron.bridge.training.config import runtime_config_update

    cfg = copy.deepcopy(cfg)
    # The fields whose default Bridge probes on the building machine (is TE importable?) that the recipe kept at this
    # machine's answer: the job builds its config on the target, so they are probed again there (the GPT3 175B recipe
    # defers the embedding wgrad, which Core allows only with the gradient-accumulation fusion TE provides).
    probed = [f for f in dataclasses.fields(cfg.model) if getattr(f.default_factory, "__module__", None) == FUSIONS]
    with stack.silenced():  # TE absent here: "Fusion disabled"
        kept = [f for f in probed if getattr(cfg.model, f.name) == f.default_factory()]
    if res.bridge_asserts and cfg.comm_overlap is not None:
        cfg.comm_overlap.overlap_moe_expert_parallel_comm = cfg.comm_overlap.delay_wgrad_compute = False
    raised, warned, capture = None, [], logging.handlers.BufferingHandler(capacity=sys.maxsize)
    capture.setLevel(logging.WARNING)
    root, saved_env = logging.getLogger(), dict(os.environ)
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers, root.level = [capture], logging.WARNING
    try:
        with warnings.catch_warnings(record=True) as caught, _target_stack(target):
            warnings.simplefilter("always")
            os.environ.update(WORLD_SIZE=str(target.world_size), RANK="0", LOCAL_RANK="0")
            try:
                for f in kept:
                    setattr(cfg.model, f.name, f.default_factory())
                runtime_config_update(cfg)
                _dispatcher_preconditions(cfg.model)
            except Exception as exc:  # noqa: BLE001 - whatever the stack raises at start is the finding
                raised = (_where(exc), f"{type(exc).__name__}: {exc}")
    finally:
        root.handlers, root.level = saved_handlers, saved_level
        os.environ.clear()
        os.environ.update(saved_env)
    warned += [(_module_of(w.filename), str(w.message)) for w in caught]
    warned += [(record.name, record.getMessage()) for record in capture.buffer]
    return Said(raised, tuple(dict.fromkeys(warned)))


def _dispatcher_preconditions(model) -> None:
    """Core's _NCCLEPManager checks its config before touching a process group or a buffer: construct it with none."""
    if not (model.moe_token_dispatcher_type == "flex" and model.moe_flex_dispatcher_backend == "ncclep"):
        return
    from megatron.core.transformer.moe import token_dispatcher

    ep, tp = model.expert_model_parallel_size or 1, model.expert_tensor_parallel_size or 1
    token_dispatcher._NCCLEPManager(
        group=None,
        num_local_experts=model.num_moe_experts // ep,
        router_topk=model.moe_router_topk * tp,
        num_experts=model.num_moe_experts * tp,
        config=model,
    )


@contextlib.contextmanager
def _target_stack(target: Target):
    """The target's TE and GPU, and no process group; every module first imported inside is dropped after (none keeps
    the stand-ins)."""
    import torch
    from megatron.core import utils as core_utils
    from packaging.version import Version

    te = target.te_version or locked_te()
    hw = hardware.HARDWARE[target.gpu]
    major, minor = GPU_CAPABILITY[target.gpu]
    gpu = types.SimpleNamespace(name=f"NVIDIA {hw.name}", major=major, minor=minor, total_memory=int(hw.hbm_gb * 2**30))
    before = set(sys.modules)
    patches = [
        (core_utils, "_te_version", Version(te) if target.te_available else Version("0.0.0")),
        (torch.cuda, "get_device_capability", lambda *_: (gpu.major, gpu.minor)),
        (torch.cuda, "get_device_properties", lambda *_: gpu),
        # pretrain() runs runtime_config_update before initialize_megatron: no process group yet, so Bridge's
        # get_world_size_safe reads WORLD_SIZE, whatever group the planning process holds (a test's one-rank group)
        (torch.distributed, "is_initialized", lambda: False),
    ]
    if target.te_available:
        for module, names in TE_KERNELS.items():
            mod = importlib.import_module(module)
            patches += [(mod, name, _te_kernel) for name in names if getattr(mod, name, None) is None]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    if target.te_available and "transformer_engine" not in sys.modules and not te_stub.real_te_available():
        # TE's optimizers module, FusedAdam only (the finally below drops it with every module first imported inside)
        for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["transformer_engine.pytorch.optimizers"].FusedAdam = _FusedAdam
    try:
        with te_flag(target.te_available, target.te_version):
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for name in set(sys.modules) - before:  # the served TE optimizers among them
            sys.modules.pop(name, None)


# The TE kernels Core's config checks look up (None where TE is absent): the fused RoPE (transformer_config's
# apply_rope_fusion check), the fused permutation (moe_permute_fusion), TE's NCCL EP dispatch (the ncclep manager).
TE_KERNELS = {
    "megatron.core.models.common.embeddings.rope_utils": (
        "fused_apply_rotary_pos_emb",
        "fused_apply_rotary_pos_emb_thd",
    ),
    "megatron.core.transformer.moe.moe_utils": (
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_unpermute",
    ),
    "megatron.core.transformer.moe.token_dispatcher": ("nccl_ep_dispatch",),
}


def _te_kernel(*_args, **_kwargs):
    raise RuntimeError("a Transformer Engine kernel stand-in was called: the start-up check runs no kernel")


class _FusedAdam:
    """TE's `transformer_engine.pytorch.optimizers.FusedAdam` as Core's OptimizerConfig inspects it: the arguments of
    the precision-aware optimizer (TE >= 2.1: transformer_engine/pytorch/optimizers/fused_adam.py)."""

    def __init__(
        self, params, *, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None, use_decoupled_grad=False
    ):
        raise RuntimeError("TE's FusedAdam stand-in: the start-up check builds no optimizer")


@cache
def locked_te() -> str:
    """The Transformer Engine uv.lock pins for the `gpu` extra (a profile naming its container's TE overrides it)."""
    return stackenv.locked()["transformer-engine"]


def _module_of(filename: str) -> str:
    """megatron/core/transformer/transformer_config.py → megatron.core.transformer.transformer_config."""
    return filename.replace("\\", "/").split("site-packages/")[-1].removesuffix(".py").replace("/", ".")


def _where(exc: BaseException) -> str:
    """module:function of the deepest frame in the stack's own code (Bridge, Core), else the deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/megatron/" in f.filename.replace("\\", "/")] or frames
    return f"{_module_of(ours[-1].filename)}:{ours[-1].name}"


def findings(said: Said, cfg, rows: list[Row]) -> tuple[list[Row], list[Finding]]:
    """The audit's part of what the stack said: an exception an error (with the nearest SET), a warning a warning,
    and a warning that loses an overlap the row shows on: that row off with the stack's reason, and an error."""
    rows, out = list(rows), []
    if said.raised:
        where, msg = said.raised
        text = one_line(f"the job would stop at start: {where} raises {msg}")
        fix = nearest_fix(msg, cfg)
        out.append(Finding("error", "stack_rejects", text + (f"; set {fix}" if fix else ""), fix))
    for where, msg in said.warned:
        lost = [r for r in rows if r.state == ON and LOST.search(msg)]
        lost = [r for r in lost if re.search(rf"\b{re.escape(STACK_NAME.get(r.name, r.name))}\b", msg)]
        for row in lost:
            rows[rows.index(row)] = Row(row.name, OFF, one_line(f"lost at start: {where}: {msg}"))
            text = one_line(f"{row.name} is claimed but the stack drops it at start: {where}: {msg}")
            out.append(Finding("error", "overlap_lost_at_start", text, nearest_fix(msg, cfg)))
        if not lost:
            out.append(Finding("warning", "stack_warns", one_line(f"at start, {where} warns: {msg}")))
    return rows, out


def nearest_fix(msg: str, cfg) -> str | None:
    """The SET= a stack message asks for: its `[section.]field=value` pairs whose field is in the config and whose
    value is not the config's (the others restate the problem); None where the message names none."""
    sets = []
    for dotted, raw in ASSIGNMENT.findall(msg):
        section, _, name = dotted.rpartition(".")
        section = section or next((s for s in _SECTIONS if hasattr(getattr(cfg, s, None), name)), "")
        if not hasattr(getattr(cfg, section, None), name):
            continue
        value = raw.strip("'\"")
        value = {"True": "true", "False": "false", "None": "null"}.get(value, value)
        have = getattr(getattr(cfg, section), name)
        if str(have).lower() != value.lower() and not (have is None and value == "null"):
            sets.append(f"{section}.{name}={value}")
    return " ".join(dict.fromkeys(sets)) or None


# The ConfigContainer sections a message's field is looked up in, the model's first (most messages are Core's).
_SECTIONS = ("model", "ddp", "optimizer", "comm_overlap", "mixed_precision", "train", "dataset", "checkpoint")
