"""Layout search: every TP/PP/VPP/CP/MBS(/EP) split of a model over N H100s that divides (the audit's rules), fits
memory and keeps the overlap stack on, ranked, each with a one-line "why" (docs/forking.md, step 2, says the rules).

Each layout is the recipe's own config at that layout (`Recipe.build`: what the forked file builds), sized and
predicted by the plan's own code (sizing.memory.estimate; Bridge's resolve, the audit's overlap table and
bridge/build.py model_inputs, on the cluster's calibration), so the number the search ranks a layout by is the number
`make plan` of the written file prints. The sort key is `_rank`; each runner-up says why it loses (`why_loses`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from overlapkit.bridge import presets, stack
from overlapkit.bridge.audit import audit, split_violations
from overlapkit.bridge.build import model_inputs, workload_of
from overlapkit.bridge.moe import expert_split_violations
from overlapkit.bridge.overlap import resolve
from overlapkit.errors import BadInput
from overlapkit.sizing import calibration, memory, throughput
from overlapkit.sizing.memory import MemoryEstimate, Workload, first_stage_layers
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.shape import ModelShape, head_dim_problem
from overlapkit.spec.topology import DEFAULT_GPU, GPUS_PER_NODE, Layout, Target

TPS, CPS, MBSS = (1, 2, 4, 8), (1, 2, 4), (1, 2)  # TP stays inside one 8-GPU NVLink node
# The estimate is a model, not a measurement: a layout within 10% of the budget is one allocator spike from an OOM on
# step 1, so it ranks after every layout with more headroom (still listed: it does fit the estimate).
TIGHT_FRACTION = 0.10
# Predictions within 2% of the best count as a tie: the model does not resolve less (its median error on NVIDIA's
# published runs is a few percent and its leave-one-out error up to 15%, docs/throughput.md), so the rules of thumb
# decide among them.
TIE_FRACTION = 0.02


class LayoutSearchError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    vpp: int | None
    cp: int
    dp: int
    mbs: int
    gbs: int
    preset: str | None  # exact Bridge preset, presets.DEFAULT_TP_CONFIG (explicit opt-in), or None for TP=1
    memory: MemoryEstimate
    why: str = ""
    prediction: throughput.Prediction | None = None
    ep: int = 1  # expert parallelism (MoE shapes only)
    loses: str = ""  # why it ranks after the first candidate (empty for the first)
    layout: Layout | None = None  # what the recipe file's LAYOUT says
    workload: Workload | None = None  # the recipe's config at this layout, as the memory and throughput models read it

    @property
    def tflops(self) -> float:
        return self.prediction.tflops_per_gpu if self.prediction else 0.0

    @property
    def exact_preset(self) -> bool:
        return self.preset != presets.DEFAULT_TP_CONFIG

    def describe(self) -> str:
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        return f"TP{self.tp} PP{self.pp} CP{self.cp} VP{self.vpp or '-'}{ep} DP{self.dp} MBS{self.mbs} GBS{self.gbs}"


def layout_errors(
    s: ModelShape, gpus: int, tp: int, pp: int, vpp: int | None, cp: int, mbs: int, gbs: int, ep: int = 1
):
    """Why this split does not divide (the audit's rules, bridge/moe.py's for the experts); empty when it does."""
    errs = []
    if tp not in TPS:
        errs.append(f"TP{tp} is not one of {TPS} (TP stays inside an {GPUS_PER_NODE}-GPU node)")
    if gpus % (tp * pp * cp):
        return errs + [f"{gpus} GPUs are not divisible by TP·PP·CP={tp * pp * cp}"]
    dp = gpus // (tp * pp * cp)
    if pp > 1 and not (vpp and vpp > 1):
        errs.append(f"PP{pp} needs VPP>1 for p2p overlap")
    shape = dict(seq=s.seq, layers=s.layers, units=s.pipeline_units, heads=s.heads, groups=s.query_groups, ffn=s.ffn)
    split = split_violations(**shape, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, mbs=mbs, gbs=gbs)
    errs += [msg for _, msg in split]
    if s.is_moe:
        moe = expert_split_violations(experts=s.experts, ep=ep, etp=1, pp=pp, world=gpus, ffn=s.moe_ffn)
        errs += [msg for _, msg in moe]
    if pp > 1 and not gbs % (dp * mbs) and gbs // (dp * mbs) < pp:
        errs.append(f"GBS {gbs} gives {gbs // (dp * mbs)} microbatches, fewer than PP{pp}: the pipeline never fills")
    return errs


@dataclass(frozen=True)
class Recipe:
    """What the search ranks the layouts of: a model of `shape` whose `build(layout, preset)` returns the config the
    recipe's file builds at `layout` and the OverlapIntent it registers (None: the default), for the userbuffers
    preset `preset` (as Candidate.preset). Each layout is sized and predicted as make plan sizes and predicts the
    file: on `gpu`, with the calibration `cal` (the cluster's, make calibrate; else the published constants)."""

    shape: ModelShape
    build: Callable[[Layout, str | None], tuple[object, OverlapIntent | None]]
    gpu: str = DEFAULT_GPU
    cal: calibration.Calibration = calibration.PUBLISHED

    def at(self, layout: Layout, preset: str | None, gpus: int) -> tuple[object, OverlapIntent, Target]:
        """The recipe at `layout`: its config (the overlap stack applied), the intent it registers, the target."""
        with stack.silenced():  # the build's notices only: resolve's warnings are the audit's evidence
            cfg, intent = self.build(layout, preset)
        return cfg, intent or OverlapIntent(), Target(nodes=gpus // GPUS_PER_NODE, gpu=self.gpu)

    def predict(self, cfg, intent: OverlapIntent, target: Target) -> throughput.Prediction:
        """plan.build's prediction of the config: Bridge's resolve, the audit's overlap table, model_inputs."""
        res = resolve(cfg, target)
        return model_inputs(cfg, res, audit(cfg, target, res, intent).rows, target, self.cal).predict()


def divisors(n: int) -> list[int]:
    """The divisors of `n` ≥ 1, ascending: √n steps, so a split search never walks every number up to n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _splits(s: ModelShape, gpus: int, fixed: dict):
    """Every split to try. PP ranges over the divisors of GPUs/(TP·CP) up to the pipeline units, VPP over the
    divisors ≥ 2 of units/PP (PP·VPP must divide the units: audit.split_violations), so the walk is over divisors,
    not over every number up to the layer count."""
    units = s.pipeline_units
    # EP sizes: powers of two that divide the experts (>1: the EP all-to-all overlap path); 1 for dense.
    eps = [e for e in (2**i for i in range(1, 11)) if s.experts % e == 0] if s.is_moe else [1]
    # Each size's values to try; a pinned size, its one value.
    choices = {"tp": TPS, "cp": CPS, "mbs": MBSS, "ep": eps} | {k: [v] for k, v in fixed.items()}
    for tp, cp in itertools.product(choices["tp"], choices["cp"]):
        per = gpus // (tp * cp) if gpus % (tp * cp) == 0 else 0  # 0 has no divisors: no PP
        for pp in choices.get("pp", [p for p in divisors(per) if p <= units]):
            vpps = [None] if pp == 1 else [v for v in divisors(max(units // pp, 1)) if v >= 2]
            for vpp, mbs, ep in itertools.product(choices.get("vpp", vpps), choices["mbs"], choices["ep"]):
                yield tp, pp, (vpp if pp > 1 else None), cp, mbs, ep


def tight(c: Candidate) -> bool:
    return c.memory.headroom_gb < TIGHT_FRACTION * c.memory.budget_gb


def _class(c: Candidate) -> tuple[bool, bool]:
    """What ranks a layout after others whatever its prediction: tight memory (a crash risk), then DP1 (the audit's
    dp1 warning: no DP overlap). The throughput model prices DP1's unhidden reduce, but `make new-recipe` writes a
    recipe its own audit warns about only when no layout with DP>1 fits."""
    return tight(c), c.dp == 1


def _rank(c: Candidate, best_tflops: float) -> tuple:
    """The sort key, best first: the class (_class); then the predicted throughput, outside the tie band of the
    leading class's best (`best_tflops`); then the rules of thumb, in order (_RULE_NAMES), which break the ties."""
    tied = c.tflops >= best_tflops * (1 - TIE_FRACTION)
    per_chunk = first_stage_layers(c.workload)[0]
    rules = (not c.exact_preset, c.pp, c.tp, c.cp, c.ep, per_chunk < 2, -(c.vpp or 1), c.mbs, -c.memory.headroom_gb)
    return (*_class(c), not tied, 0.0 if tied else -c.tflops, *rules)


_RULE_NAMES = (
    "no exact userbuffers preset",
    "larger PP",
    "larger TP",
    "larger CP",
    "larger EP",
    "fewer than 2 layers per chunk",
    "smaller VPP",
    "larger MBS",
    "less memory headroom",
)


def why_loses(c: Candidate, best: Candidate, best_tflops: float) -> str:
    """One phrase: the first part of the sort key (_rank) on which `c` ranks after `best`."""
    key, best_key = _rank(c, best_tflops), _rank(best, best_tflops)
    first = next((i for i, (a, b) in enumerate(zip(key, best_key, strict=True)) if a != b), None)
    if first is None:
        return "ties on every rule"
    if first == 0:
        return f"tight memory: {c.memory.headroom_gb:.1f} GB free (< 10% of the budget)"
    if first == 1:
        return "DP1: no DP overlap (the audit warns); a layout with DP>1 fits"
    if first <= 3:  # outside the tie band (the leading class's best is inside it)
        mine, theirs = ({n: t for n, t, _ in x.prediction.terms} for x in (c, best))
        worse = sorted(((mine.get(k, 0) - theirs.get(k, 0), k) for k in mine | theirs), reverse=True)[:2]
        parts = ", ".join(f"+{d:.2f} s {k}" for d, k in worse if d > 0.005)
        return f"{1 - c.tflops / best.tflops:.1%} slower predicted" + (f" ({parts} per step)" if parts else "")
    return f"within {TIE_FRACTION:.0%} of the best prediction (a tie); {_RULE_NAMES[first - 4]}"


def _why(c: Candidate, s: ModelShape, min_pp: int) -> str:
    if c.tp == 1:
        tp = "TP1: no TP collectives (TP overlap n/a)"
    elif c.exact_preset:
        tp = f"TP{c.tp} inside a node with Bridge preset {c.preset}"
    else:
        tp = (
            f"TP{c.tp} inside a node; no Bridge preset for h{s.hidden} tp{c.tp} mbs{c.mbs} seq{s.seq}: explicit "
            f"overlap.tp_preset={presets.DEFAULT_TP_CONFIG} (TE's default userbuffers config)"
        )
    pp = "PP1" if c.pp == 1 else f"PP{c.pp}×VP{c.vpp} interleaved (p2p overlap on)"
    pp += " is the smallest PP that fits" if c.pp == min_pp else ""
    cp = f"; CP{c.cp}" if c.cp > 1 else ""
    cp += f"; EP{c.ep}: {s.experts // c.ep} experts per rank, all-to-all overlapped" if c.ep > 1 else ""
    dp = f"DP{c.dp} overlaps grad reduce-scatter/param all-gather" if c.dp > 1 else "DP1: no DP overlap"
    mem = f"{c.memory.total_gb:.1f} of {c.memory.budget_gb:.1f} GB" + (" (tight: < 10% free)" if tight(c) else "")
    pred = f"; predicted {c.tflops:.0f} TFLOP/s/GPU" if c.prediction else ""
    return f"{tp}; {pp}{cp}; {dp}; {mem}{pred}"


def search(recipe: Recipe, gpus: int, *, gbs: int, fixed: dict | None = None, top: int = 5):
    """The `top` best layouts of `recipe` on `gpus` GPUs of `recipe.gpu`, best first; LayoutSearchError (one line)
    when none qualifies. `fixed` pins any of tp/pp/vpp/cp/mbs/ep (e.g. from the command line); EP is searched for
    MoE shapes only."""
    s, gpu = recipe.shape, recipe.gpu
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    stack.import_bridge()  # presets are read from Bridge; this prepares the process (TE shim, offline) once
    if gpus < GPUS_PER_NODE or gpus % GPUS_PER_NODE:
        raise LayoutSearchError(f"{gpus} GPUs: use a multiple of {GPUS_PER_NODE} (whole H100 nodes)")
    if bad := [f"{k}={v}" for k, v in fixed.items() if not isinstance(v, int) or v < 1]:
        raise LayoutSearchError(f"pinned {', '.join(bad)}: layout sizes are positive whole numbers")
    if fixed.get("tp", 1) not in TPS:
        raise LayoutSearchError(f"TP{fixed['tp']} is not one of {TPS} (TP stays inside an {GPUS_PER_NODE}-GPU node)")
    if fixed.get("ep", 1) > 1 and not s.is_moe:
        raise LayoutSearchError(f"EP={fixed['ep']} pinned for a dense model: expert parallelism needs experts")
    errs = [msg] if (msg := head_dim_problem(s.hidden, s.heads, s.kv_channels)) else []
    if s.heads % s.query_groups:
        errs.append(f"heads {s.heads} are not divisible by query groups {s.query_groups} (GQA)")
    if errs:
        raise LayoutSearchError(f"model shape {s.describe()} does not divide: {'; '.join(errs)}")
    why_not, fitting, best_unfit = Counter(), [], None
    for tp, pp, vpp, cp, mbs, ep in _splits(s, gpus, fixed):
        if errs := layout_errors(s, gpus, tp, pp, vpp, cp, mbs, gbs, ep):
            why_not[errs[0]] += 1
            continue
        preset = None  # TP1: no TP overlap to configure
        if tp > 1:
            try:
                preset = presets.select(presets.PresetKey.of(s, tp=tp, cp=cp, mbs=mbs, gpu=gpu))
            except presets.PresetError:
                preset = presets.DEFAULT_TP_CONFIG
        layout = Layout(tp=tp, pp=pp, cp=cp, vpp=vpp, mbs=mbs, gbs=gbs, seq=s.seq, ep=ep, etp=1 if s.is_moe else None)
        cfg, intent, target = recipe.at(layout, preset, gpus)
        w = workload_of(cfg, target)
        est = memory.estimate_workload(w, target.gpu)  # memory.estimate of the config, its workload read once
        c = Candidate(tp, pp, vpp, cp, w.dp, mbs, gbs, preset, est, ep=ep, layout=layout, workload=w)
        if est.fits:
            fitting.append(replace(c, prediction=recipe.predict(cfg, intent, target)))
        elif best_unfit is None or est.total_gb < best_unfit.memory.total_gb:
            best_unfit = c
    pinned = f" with {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    if not fitting and best_unfit is not None:
        m = best_unfit.memory
        raise LayoutSearchError(
            f"no layout of {s.describe()} on {gpus} GPUs{pinned} fits an {gpu.upper()}: the smallest estimate is "
            f"{m.total_gb:.0f} GB > {m.budget_gb:.1f} GB ({best_unfit.describe()}); use more GPUs"
        )
    if not fitting:
        ranked = sorted(why_not, key=lambda r: (r.startswith(f"{gpus} GPUs"), -why_not[r]))  # specific reasons first
        kinds = {re.sub(r"\d+", "#", r): r for r in reversed(ranked)}  # one example of each kind of reason
        reasons = "; ".join(sorted(kinds.values(), key=ranked.index)[:2]) or "no split to try"
        raise LayoutSearchError(f"no layout of {s.describe()} on {gpus} GPUs{pinned} divides: {reasons}")
    lead = min(_class(c) for c in fitting)
    best_tflops = max(c.tflops for c in fitting if _class(c) == lead)  # the tie band is the leading class's
    fitting.sort(key=lambda c: _rank(c, best_tflops))
    min_pp = min(c.pp for c in fitting)
    return [
        replace(c, why=_why(c, s, min_pp), loses=why_loses(c, fitting[0], best_tflops) if i else "")
        for i, c in enumerate(fitting[:top])
    ]
