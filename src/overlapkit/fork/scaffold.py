"""Fork a recipe for a new model size: shape → layout search → recipe file → build + audit + memory → file kept.

The new file reuses the FROM recipe's Bridge base function (`base` in its module) with the new shape, then goes
through recipes._base.h100_pretrain/register exactly like the shipped recipes. It is written to a hidden temp file,
loaded and registered under `recipes.<name>`, planned and audited; only when the audit is clean and the memory
estimate fits is it renamed into place. On any failure the temp file and the registry entry are removed: a bad
request leaves nothing behind and fails with one line.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio
from overlapkit.bridge import inputs, presets, registry, stack
from overlapkit.bridge.build import make_plan
from overlapkit.errors import AuditFailed, BadInput
from overlapkit.fork import layout_search
from overlapkit.names import checked_name, inside
from overlapkit.sizing import calibration, hardware
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.request import Cluster
from overlapkit.spec.shape import ModelShape, head_dim_follows
from overlapkit.spec.topology import GPUS_PER_NODE

# Each shape flag's config field, whose size rule (bridge/inputs.py: SIZES, CEILINGS) it answers to before any search.
SHAPE_KEYS = dict(hidden="hidden_size", layers="num_layers", heads="num_attention_heads")
SHAPE_KEYS |= dict(query_groups="num_query_groups", ffn="ffn_hidden_size", seq="seq_length")
SHAPE_KEYS |= dict(experts="num_moe_experts", topk="moe_router_topk")
SHAPE_FIELDS = tuple(SHAPE_KEYS)
LAYOUT_FIELDS = ("tp", "pp", "vpp", "cp", "mbs", "ep")
MOE_SHAPE = ("experts", "topk")  # only for a FROM recipe with experts


class ForkError(BadInput):
    """One-line, user-facing: a bad request, nothing written (exit 2)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


@dataclass
class ForkRequest:
    from_name: str
    name: str
    shape: dict = field(default_factory=dict)  # any of SHAPE_FIELDS; the rest from the FROM recipe
    layout: dict = field(default_factory=dict)  # any of LAYOUT_FIELDS pinned; the rest searched
    gpus: int | None = None  # default: N in the name
    dtype: str | None = None  # bf16 | fp8cs; default: the name's suffix
    gbs: int | None = None  # default: the FROM recipe's
    model: str | None = None  # registry label; default from the name ("llama3_34b" → "Llama3 34B")
    recipes_dir: Path = registry.RECIPES_DIR
    gpu: str = hardware.DEFAULT_GPU  # GPU=: what the layout search sizes memory and ranks throughput for
    cluster: str | None = None  # CLUSTER=: whose calibration (make calibrate) ranks the layouts; None: published


@dataclass
class ForkResult:
    name: str
    path: Path
    choice: layout_search.Candidate
    alternatives: list
    plan: object  # overlapkit.bridge.build.Plan (its memory estimate fits)


def model_label(prefix: str) -> str:
    return " ".join(t.upper() if re.fullmatch(r"a?\d+(\.\d+)?[bm]", t) else t.capitalize() for t in prefix.split("_"))


def check_request(req: ForkRequest) -> tuple[str, int, str]:
    """NAME and FROM, before the Bridge import (the registry's names as data, nothing imported): the name's pattern
    and what it implies (GPUs, dtype), the directory, a name already taken, a FROM none declares. Returns (model
    prefix, GPUs, dtype); ForkError (one line) otherwise. A name only a module's import knows is refused after the
    import (fork)."""
    if not (m := registry.NAME_RE.fullmatch(req.name)):
        raise ForkError(f"recipe name {req.name!r} must be <model>_pretrain_<N>gpu_h100_<bf16|fp8cs>")
    # The pattern holds: what the one rule for names adds is the length a file name may have (its BadInput: exit 2).
    checked_name(req.name, "NAME", "a recipe's name is its file's and its run directories' name")
    gpus, dtype = int(m["gpus"]), m["dtype"]
    if req.gpus is not None and req.gpus != gpus:
        raise ForkError(f"--gpus {req.gpus} contradicts the name's {gpus}gpu: rename or change --gpus")
    if req.dtype is not None and req.dtype != dtype:
        raise ForkError(f"--dtype {req.dtype} contradicts the name's _{dtype} suffix")
    if gpus < GPUS_PER_NODE or gpus % GPUS_PER_NODE:
        raise ForkError(f"{gpus} GPUs: use a multiple of {GPUS_PER_NODE} (whole H100 nodes)")
    if gpus > inputs.MAX_NODES * GPUS_PER_NODE:
        raise ForkError(f"{gpus} GPUs: at most {inputs.MAX_NODES * GPUS_PER_NODE:,} ({inputs.MAX_NODES:,} nodes)")
    for flag, value in req.shape.items():
        if value is not None and (problem := inputs.size_problem(f"model.{SHAPE_KEYS[flag]}", value)):
            raise ForkError(f"{flag.upper()}={value}: {problem.partition(': ')[2]} ({SHAPE_KEYS[flag]})")
    if not Path(req.recipes_dir).is_dir():
        raise ForkError(f"--recipes-dir {req.recipes_dir} is not a directory")
    for where in {Path(req.recipes_dir), registry.RECIPES_DIR}:
        if (where / f"{req.name}.py").exists():
            raise ForkError(f"recipe {req.name} already exists ({where / f'{req.name}.py'}): pick another name")
    if req.name in (registry.declared_nodes() or {}):
        raise ForkError(f"recipe {req.name} is already registered: pick another name")
    try:
        registry.check_declared(req.from_name)
    except registry.UnknownRecipe as exc:
        raise ForkError(f"FROM={req.from_name}: {exc}") from None
    return m["model"], gpus, dtype


def _base_shape(cfg, req: ForkRequest, dtype: str) -> ModelShape:
    """The FROM recipe's shape with the requested fields changed, in the dtype the name asks for."""
    new = {k: v for k, v in req.shape.items() if v is not None}
    for k, v in new.items():
        if not isinstance(v, int) or v < 1:
            raise ForkError(f"--{k.replace('_', '-')} {v!r}: must be a positive whole number")
    shape = ModelShape.of(cfg)
    if not shape.is_moe and (moe := [k for k in MOE_SHAPE if k in new]):
        raise ForkError(
            f"--{moe[0]} needs an MoE FROM recipe ({req.from_name} is dense): fork a Qwen3/DeepSeek/GPT-OSS one"
        )
    if new.get("topk", 0) > new.get("experts", shape.experts):
        raise ForkError(f"--topk {new['topk']} exceeds the {new.get('experts', shape.experts)} experts")
    if shape.is_moe and "layers" in new:
        if shape.moe_layers != shape.layers:  # DeepSeek-V3: moe_layer_freq names each layer
            raise ForkError(f"--layers on {req.from_name}: its dense/MoE layer pattern is per layer; keep its depth")
        new["moe_layers"] = new["layers"]  # every layer is MoE (Qwen3, GPT-OSS)
    if {"hidden", "heads"} & set(new) and head_dim_follows(shape.hidden, shape.heads, shape.kv_channels):
        new["kv_channels"] = None  # hidden / heads again for the new shape (shape.head_dim_problem: it must divide)
    return dataclasses.replace(shape, **new, dtype="fp8" if dtype == "fp8cs" else "bf16")


def shape_fields(s: ModelShape) -> dict:
    """The model fields the forked file's SHAPE sets on its base (with_shape): the search builds each layout with
    the same ones. An MoE file keeps the base's kv_channels (Qwen3's head_dim is not hidden/heads)."""
    if s.is_moe:
        out = dict(hidden_size=s.hidden, num_layers=s.layers, num_attention_heads=s.heads)
        out.update(num_query_groups=s.query_groups, ffn_hidden_size=s.ffn)
        return out | dict(num_moe_experts=s.experts, moe_router_topk=s.topk)
    out = dict(hidden_size=s.hidden, num_layers=s.layers, ffn_hidden_size=s.ffn)
    return out | dict(num_attention_heads=s.heads, num_query_groups=s.query_groups, kv_channels=s.head_dim)


def intent_for(from_intent: OverlapIntent, preset: str | None, moe: bool) -> OverlapIntent | None:
    """The OverlapIntent the forked file registers for a layout whose userbuffers preset is `preset` (a
    layout_search.Candidate's): the explicit opt-in to TE's default config where no Bridge preset fits; an MoE fork
    keeps the FROM recipe's delayed wgrad. NVIDIA's kept-off overlaps belong to NVIDIA's layouts, so the fork runs
    every overlap its layout allows. None (dense, nothing to say): every overlap on, the preset selected by shape."""
    args = {"delay_wgrad": True} if moe and from_intent.delay_wgrad else {}
    if preset == presets.DEFAULT_TP_CONFIG:
        args["tp_preset"] = presets.DEFAULT_TP_CONFIG
    return OverlapIntent(**args) if args or moe else None


def recipe_at(req: ForkRequest, shape: ModelShape, dtype: str, base_module: str) -> layout_search.Recipe:
    """The forked file at any layout, for the layout search: the calls its template makes (TEMPLATE, MOE_TEMPLATE:
    recipes._base's h100_pretrain/moe_pretrain on `with_shape(base, SHAPE)`, the base module's KNOBS, intent_for),
    on the calibration the fork's plan predicts with. The Bridge base function runs once; each layout starts from a
    copy of its config."""
    kit, mod = registry.builders(), sys.modules[base_module]
    if shape.is_moe and not hasattr(mod, "KNOBS"):
        raise ForkError(f"{base_module} has no MoE dispatcher knobs `KNOBS` to fork with")
    with stack.silenced():
        built = mod.base()
    base = kit.with_shape(lambda: copy.deepcopy(built), shape_fields(shape))
    from_intent = registry.get(req.from_name).intent

    def build(layout, preset):
        intent = intent_for(from_intent, preset, shape.is_moe)
        if shape.is_moe:
            return kit.moe_pretrain(base, dtype, layout, mod.KNOBS, intent), intent
        return kit.h100_pretrain(base, dtype, layout, intent), intent

    return layout_search.Recipe(shape, build, req.gpu, calibration.for_cluster(req.cluster))


def _fields(name: str, fields: dict, per_line: int = 3) -> str:
    """`NAME = dict(a=1, b=2, c=3)` then `NAME.update(...)` lines of `per_line` fields each."""
    items = [f"{k}={v}" for k, v in fields.items()]
    lines = [", ".join(items[i : i + per_line]) for i in range(0, len(items), per_line)]
    return "\n".join(f"{name} = dict({x})" if not i else f"{name}.update({x})" for i, x in enumerate(lines))


def _intent_text(intent: OverlapIntent) -> str:
    """`OverlapIntent(delay_wgrad=True, tp_preset="default")`: the fields that differ from the default."""
    default, args = OverlapIntent(), []
    for f in dataclasses.fields(intent):
        if (v := getattr(intent, f.name)) != getattr(default, f.name):
            args.append(f'{f.name}="{v}"' if isinstance(v, str) else f"{f.name}={v}")
    return f"OverlapIntent({', '.join(args)})"


TEMPLATE = '''"""{doc}
"""

from recipes._base import {imports}
{knobs}from {base_module} import base as _from_base

{shape}
LAYOUT = {layout_line}
INTENT = {intent}
base = with_shape(_from_base, SHAPE)


@register(model="{model}", source="forked from {from_name}", intent=INTENT)
def {name}():
    """{dtype_word}, {layout}, seq {seq}{experts}."""
    return {call}
'''


def render(req: ForkRequest, model: str, gpus: int, dtype: str, s, c, base_module: str) -> str:
    imports, knobs = "Layout, h100_pretrain, register, with_shape", ""
    call, experts = f'h100_pretrain(base, "{dtype}", LAYOUT, INTENT)', ""
    intent = intent_for(registry.get(req.from_name).intent, c.preset, s.is_moe)
    if s.is_moe:  # the base module's dispatcher knobs, and the experts in the builder's docstring
        imports = "Layout, OverlapIntent, moe_pretrain, register, with_shape"
        knobs = f"from {base_module} import KNOBS\n"
        call = f'moe_pretrain(base, "{dtype}", LAYOUT, KNOBS, INTENT)'
        experts = f", top-{s.topk} of {s.experts} experts"
        intent_line = _intent_text(intent)
    elif intent is None:
        intent_line = "None  # userbuffers preset: " + (c.preset or "n/a (TP=1)")
    else:
        intent_line = _intent_text(intent) + "  # no Bridge userbuffers preset fits: explicit opt-in"
        imports = "Layout, OverlapIntent, h100_pretrain, register, with_shape"
    names = ["tp", "pp", "cp", "vpp", "mbs", "gbs", "seq"] + (["ep", "etp"] if s.is_moe else [])  # the search's Layout
    nodes = gpus // GPUS_PER_NODE
    head = f"{model} on {gpus} H100s ({nodes} nodes), forked from {req.from_name} by launch/new_recipe.py."
    body = (
        f"Shape: hidden {s.hidden}, {s.layers} layers, {s.heads} heads, {s.query_groups} query groups, FFN {s.ffn}, "
        f"seq {s.seq}; vocabulary ({s.vocab}), tokenizer and the rest from `{base_module}.base`. "
        f"Layout {c.describe()} chosen by overlapkit.fork.layout_search: {c.why}."
    )
    if req.gpu != hardware.DEFAULT_GPU:  # the name says h100; the layout was sized for another GPU (GPU=)
        body += f" Searched for {hardware.HARDWARE[req.gpu].name} (GPU={req.gpu}): plan it with GPU={req.gpu}."
    doc = (
        "\n".join(textwrap.wrap(head, 113, break_on_hyphens=False))
        + "\n\n"
        + "\n".join(textwrap.wrap(body, 116, break_on_hyphens=False))
    )
    return TEMPLATE.format(
        doc=doc,
        imports=imports,
        knobs=knobs,
        base_module=base_module,
        shape=_fields("SHAPE", shape_fields(s)),
        layout_line=f"Layout({', '.join(f'{n}={getattr(c.layout, n)}' for n in names)})",
        intent=intent_line,
        model=model,
        from_name=req.from_name,
        name=req.name,
        dtype_word="BF16" if dtype == "bf16" else "FP8 current scaling",
        layout=c.describe(),
        seq=s.seq,
        experts=experts,
        call=call,
    )


def from_recipe(req: ForkRequest, dtype: str) -> tuple[layout_search.Recipe, int, str]:
    """The FROM recipe with the request's shape, in `dtype`: what the layout search ranks (recipe_at), the global
    batch (the FROM recipe's unless asked) and the base module the file imports."""
    try:
        entry = registry.get(req.from_name)
    except registry.UnknownRecipe as exc:
        raise ForkError(f"FROM={req.from_name}: {exc}") from None
    base_module = entry.build.__module__
    if not callable(getattr(sys.modules[base_module], "base", None)):
        raise ForkError(f"{base_module} has no Bridge base function `base` to fork from")
    with stack.silenced():
        from_cfg = entry.build()
    shape = _base_shape(from_cfg, req, dtype)
    gbs = req.gbs or from_cfg.train.global_batch_size
    return recipe_at(req, shape, dtype, base_module), gbs, base_module


def fork(req: ForkRequest) -> ForkResult:
    """Write, register and audit `recipes/<name>.py`; ForkError (one line) and no file on any failure."""
    prefix, gpus, dtype = check_request(req)
    if req.name in registry.names():
        raise ForkError(f"recipe {req.name} is already registered: pick another name")
    if unknown := set(req.layout) - set(LAYOUT_FIELDS):
        raise ForkError(f"unknown layout field(s) {sorted(unknown)}: use {', '.join(LAYOUT_FIELDS)}")
    recipe, gbs, base_module = from_recipe(req, dtype)
    try:
        cands = layout_search.search(recipe, gpus, gbs=gbs, fixed=req.layout)
    except layout_search.LayoutSearchError as exc:
        raise ForkError(str(exc)) from None
    text = render(req, req.model or model_label(prefix), gpus, dtype, recipe.shape, cands[0], base_module)
    out_dir = Path(req.recipes_dir)
    final, tmp = inside(out_dir, f"{req.name}.py"), inside(out_dir, f".{req.name}.py.tmp")
    try:
        jsonio.create_new(tmp, text)
    except FileExistsError:
        raise ForkError(
            f"{tmp} exists (another make new-recipe NAME={req.name} under way, or left by one): remove it"
        ) from None
    try:
        mod = registry.load_file(tmp, req.name)
        plan = make_plan(req.name, gpu=req.gpu, cluster=Cluster(req.cluster))  # named: its calibration
        if not plan.report.ok:
            first = plan.report.errors[0]
            more = f" (+{len(plan.report.errors) - 1} more)" if len(plan.report.errors) > 1 else ""
            raise AuditFailed(f"{req.name} fails its audit: [{first.code}] {first.message}{more}")
        if not plan.memory.fits:
            raise ForkError(f"{req.name} does not fit: {plan.memory.summary()}")
        if final.exists():  # written by someone else while we audited: never overwrite
            raise ForkError(f"recipe {req.name} appeared at {final} meanwhile: pick another name")
        os.replace(tmp, final)
        mod.__file__ = str(final)
    except BaseException as exc:
        registry.unregister(req.name)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, ForkError | AuditFailed | KeyboardInterrupt | SystemExit):
            raise
        raise ForkError(f"{req.name} does not build: {type(exc).__name__}: {exc}") from exc
    return ForkResult(req.name, final, cands[0], cands[1:], plan)
