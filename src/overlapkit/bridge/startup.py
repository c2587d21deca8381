"""The stack's own start-up checks, run on CPU before the queue (issue 42).

When a job starts, Bridge's `pretrain()` runs `runtime_config_update(cfg)`
(megatron/bridge/training/config.py): mixed-precision and comm-overlap setup, then `ConfigContainer.validate()`,
which finalizes every sub-config: the dataset, Megatron Core's DDP and optimizer configs (`OptimizerConfig`'s
post-init), the model provider (`TransformerConfig.__post_init__`, Core's model checks), train, scheduler,
checkpoint, logger, profiling. The plan runs that same function on a copy of its config, for the planned world
size, and then the NCCL EP dispatcher manager's config-only preconditions (`_NCCLEPManager.__init__`, Core's
moe/token_dispatcher.py) where the recipe uses that backend. Nothing here restates a rule: what the stack raises is
an error finding, what it warns (Python `warnings` or logging) a warning finding, and a warning that says a claimed
overlap is lost, serialized or disabled turns that overlap's row off (an error: the recipe claims it).

Mocked, because they cannot exist on a CPU machine, for the duration of the check only (restored after):
- the target's Transformer Engine: its version (Core's `megatron.core.utils.get_te_version`, which every
  `is_te_min_version` gate reads: the target's container's, else the version uv.lock pins for the `gpu` extra), and
  the TE symbols Core's config checks import to see that TE is there: `FusedAdam` (checked for the
  precision-aware optimizer's arguments), the fused RoPE kernels, TE's NCCL EP entry points;
- the GPU: `torch.cuda.get_device_capability` and `get_device_properties` answer the target GPU's (sm90 for
  H100/H200: Bridge's flex-dispatcher backend check, Core's ncclep static-shape check);
- the process: WORLD_SIZE (Bridge's `get_world_size_safe`); os.environ is restored after, since the config's
  env_vars are applied with setdefault.
What cannot run on CPU: the process-group set-up, the dispatcher's buffers, TE's kernels (docs/plan.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import logging
import os
import re
import sys
import tomllib
import traceback
import types
import warnings
from functools import cache

from overlapkit import paths
from overlapkit.bridge import stack
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


@dataclasses.dataclass(frozen=True)
class Said:
    """What the stack said while starting the config: `raised` (where, message) or None, and its warnings."""

    raised: tuple[str, str] | None
    warned: tuple[tuple[str, str], ...]


def check(cfg, target: Target, res: Resolved) -> Said:
    """Run Bridge's start-up (`runtime_config_update`) and the NCCL EP manager's preconditions on a copy of `cfg`
    for `target`, under the mocks the module docstring lists. Where Bridge's comm-overlap setup already asserted on
    an EP-overlap prerequisite (the audit reports it with its fix), the copy starts without the EP overlap, as the
    resolve does, so the rest of the config is still checked."""
    from megatron.bridge.training.config import runtime_config_update

    cfg = copy.deepcopy(cfg)
    with stack.silenced():  # this machine's answers to Bridge's build-time probes (TE absent: "Fusion disabled")
        here = {f.name: f.default_factory() for f in _probed(cfg.model)}
    if res.bridge_asserts and cfg.comm_overlap is not None:
        cfg.comm_overlap.overlap_moe_expert_parallel_comm = False
        cfg.comm_overlap.delay_wgrad_compute = False
    raised, warned, capture = None, [], _Capture()
    root, saved_env = logging.getLogger(), dict(os.environ)
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers, root.level = [capture], logging.WARNING
    try:
        with warnings.catch_warnings(record=True) as caught, _target_stack(target):
            warnings.simplefilter("always")
            os.environ.update(WORLD_SIZE=str(target.world_size), RANK="0", LOCAL_RANK="0")
            try:
                _reprobe(cfg.model, here)
                runtime_config_update(cfg)
                _dispatcher_preconditions(cfg.model, target)
            except Exception as exc:  # noqa: BLE001 - whatever the stack raises at start is the finding
                raised = (_where(exc), f"{type(exc).__name__}: {exc}")
    finally:
        root.handlers, root.level = saved_handlers, saved_level
        os.environ.clear()
        os.environ.update(saved_env)
    warned += [(_module_of(w.filename), str(w.message)) for w in caught]
    warned += capture.messages
    return Said(raised, tuple(dict.fromkeys(warned)))


def _probed(model) -> list[dataclasses.Field]:
    """The model fields whose default Bridge probes on the machine that builds the config (utils/fusions.py:
    can_enable_gradient_accumulation_fusion asks whether TE is importable)."""
    return [
        f
        for f in dataclasses.fields(model)
        if getattr(f.default_factory, "__module__", None) == "megatron.bridge.utils.fusions"
    ]


def _reprobe(model, here: dict) -> None:
    """The job builds its config on the target: where the recipe kept this machine's probed default (`here`), ask the
    probe again under the target's stack (the GPT3 175B recipe defers the embedding wgrad, which Core allows only with
    the gradient-accumulation fusion that TE provides there)."""
    for f in _probed(model):
        if getattr(model, f.name) == here[f.name]:
            setattr(model, f.name, f.default_factory())


def _dispatcher_preconditions(model, target: Target) -> None:
    """The NCCL EP manager's constructor checks its config before touching a process group or a buffer: construct
    it with no group (Core's token_dispatcher.py, _NCCLEPManager.__init__)."""
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
    """The target's TE and GPU, as the module docstring lists; every module first imported inside is dropped after,
    so nothing that probed the stand-ins keeps them."""
    import torch
    from megatron.core import utils as core_utils
    from packaging.version import Version

    te = target.te_version or locked_version("transformer-engine")
    hw = hardware.HARDWARE[target.gpu]
    major, minor = GPU_CAPABILITY[target.gpu]
    gpu = types.SimpleNamespace(name=f"NVIDIA {hw.name}", major=major, minor=minor, total_memory=int(hw.hbm_gb * 2**30))
    before = set(sys.modules)
    patches = [
        (core_utils, "_te_version", Version(te) if target.te_available else Version("0.0.0")),
        (torch.cuda, "get_device_capability", lambda *_: (gpu.major, gpu.minor)),
        (torch.cuda, "get_device_properties", lambda *_: gpu),
    ]
    if target.te_available:
        for module, names in TE_KERNELS.items():
            mod = importlib.import_module(module)
            patches += [(mod, name, _te_kernel) for name in names if getattr(mod, name, None) is None]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    served = _serve_te_optimizers() if target.te_available else []
    try:
        with te_flag(target.te_available, target.te_version):
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for name in served + [m for m in set(sys.modules) - before if m not in served]:
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


def _serve_te_optimizers() -> list[str]:
    """Put `transformer_engine.pytorch.optimizers` (FusedAdam only) into sys.modules where real TE is absent; the
    names served, for removal."""
    if "transformer_engine" in sys.modules or _importable("transformer_engine"):
        return []
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].FusedAdam = _FusedAdam
    return names


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@cache
def locked_version(package: str) -> str:
    """The version uv.lock pins for `package` (the `gpu` extra's Transformer Engine: what the NeMo container brings
    is the target's, when a cluster profile names it)."""
    lock = tomllib.loads((paths.REPO_ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == package)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record):
        self.messages.append((record.name, record.getMessage()))


def _module_of(filename: str) -> str:
    """megatron/core/transformer/transformer_config.py → megatron.core.transformer.transformer_config."""
    tail = filename.replace("\\", "/").split("site-packages/")[-1]
    return tail.removesuffix(".py").replace("/", ".")


def _where(exc: BaseException) -> str:
    """module:function of the deepest frame in the stack's own code (Bridge, Core), else the deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/megatron/" in f.filename.replace("\\", "/")] or frames
    return f"{_module_of(ours[-1].filename)}:{ours[-1].name}"


def findings(said: Said, cfg, rows: list[Row]) -> tuple[list[Row], list[Finding]]:
    """The audit's part of what the stack said: each exception an error (its message, where it came from, the
    nearest SET), each warning a warning, and each warning that loses an overlap row the audit shows on: that row
    off with the stack's reason, and an error. Returns `rows` with those switched off, and the new findings."""
    rows, out = list(rows), []
    if said.raised:
        where, msg = said.raised
        text = one_line(f"the job would stop at start: {where} raises {msg}")
        fix = nearest_fix(msg, cfg)
        out.append(Finding("error", "stack_rejects", text + (f"; set {fix}" if fix else ""), fix))
    for where, msg in said.warned:
        lost = [r for r in rows if r.state == ON and _names(msg, STACK_NAME.get(r.name, r.name))]
        lost = lost if LOST.search(msg) else []
        for row in lost:
            rows[rows.index(row)] = Row(row.name, OFF, one_line(f"lost at start: {where}: {msg}"))
            text = one_line(f"{row.name} is claimed but the stack drops it at start: {where}: {msg}")
            out.append(Finding("error", "overlap_lost_at_start", text, nearest_fix(msg, cfg)))
        if not lost:
            out.append(Finding("warning", "stack_warns", one_line(f"at start, {where} warns: {msg}")))
    return rows, out


def _names(msg: str, field: str) -> bool:
    return re.search(rf"\b{re.escape(field)}\b", msg) is not None


def nearest_fix(msg: str, cfg) -> str | None:
    """The SET= a stack message asks for: its `field=value` (or `section.field=value`) pairs whose field is in the
    config and whose value is not the config's (the others restate the problem), as `section.field=value`; None
    where the message names none."""
    sets = []
    for dotted, raw in ASSIGNMENT.findall(msg):
        section, _, name = dotted.rpartition(".")
        if not section:
            section = next((s for s in _SECTIONS if hasattr(getattr(cfg, s, None), name)), "")
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
