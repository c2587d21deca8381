"""NVIDIA's published H100 runs, planned as our recipes, against the throughput model's prediction.

The runs are the rows of the project's reference of published H100 throughput, as docs/throughput.md's validation
table copies them. Each is planned with `make_plan` as a user would: the shipped recipe of that model and precision
(FP8 → `_fp8cs`), NODES = GPUs / 8, and SET for every batch or layout size the row states; the rest stays the
recipe's. The model is compared on tokens/s/GPU, the measured quantity (TFLOP/s depends on how a release counts
attention FLOPs). The MLPerf GPT-3 175B scaling series runs software not ours, so each round is compared at its own
level (`leveled`): only the ratios within a round are checked.

`refit` fits sizing/calibration.py's constants on the runs (all, or all but one: the leave-one-out check); `rows`
and `table` render docs/throughput.md's validation table, in the test that keeps that page and the constants honest.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, replace

from overlapkit import paths
from overlapkit.sizing import calibration, throughput
from overlapkit.spec.topology import Layout

# The reference's rows, as docs/throughput.md's validation table commits them: a checkout reads nothing beside itself.
DOC = paths.REPO_ROOT / "docs" / "throughput.md"
FIT_TOL, LOO_TOL = 0.10, 0.15  # issue #25's bar: every run within ±10%, each refitted without it within ±15%
# The reference's model names (of its three tables: dense FP8, dense BF16, MoE) → our recipes' prefixes.
_MODELS = {"Llama3 8B": "llama3_8b", "Llama3.1 8B": "llama3_8b", "Llama3 70B": "llama3_70b", "GPT3 175B": "gpt3_175b"}
_MODELS |= {"Llama3.1 405B": "llama31_405b", "Qwen3 30B-A3B": "qwen3_30b_a3b", "Qwen3 235B-A22B": "qwen3_235b_a22b"}
_MODELS["DeepSeek-V3"] = "deepseek_v3"
# A run published with a blockwise variant: DeepSeek-V3's "FP8 (blockwise: 330 TFLOP/s)" (Megatron-Bridge
# docs/performance-summary.md, 25.09, DGX-H100: 338 model TFLOP/s/GPU, 330 with TE's Float8BlockScaling). Same FLOPs
# per token, so its tokens/s/GPU is the row's × 330/338: a row of its own (the blockwise GEMM rate is fitted on it),
# planned with the blockwise recipe as the `_fp8sc` perf recipe sets it.
_BLOCKWISE = re.compile(r"blockwise: (\d+) TFLOP/s")


@dataclass(frozen=True)
class Point:
    model: str
    release: str
    gpus: int
    precision: str
    layout: Layout  # the published GBS/MBS/seq and TP/PP/CP/VP (EP for MoE runs)
    tokens: float  # published tokens/s/GPU
    fp8_recipe: str | None = None  # "blockwise" for the derived blockwise row; None: the recipe's (tensorwise)
    series: str | None = None  # a scaling series' round (MLPerf "v3.1"): compared on ratios within it
    system: str = ""  # the scaling row's round · submitter · system cell
    ga: int = 0  # the scaling row's micro-batches per DP rank, as published
    fp8_params: bool = False  # the scaling row's "FP8 params"

    @property
    def key(self) -> str:
        """Unique: model / release (/ GPUs: GPT3) (/ blockwise); a scaling row: MLPerf <round · submitter · system>."""
        if self.series:
            return f"MLPerf {self.system}"
        release = re.sub(r"\s*\(.*\)", "", self.release).split(",")[0]
        key = f"{self.model} / {release}" + (f" / {self.gpus}" if self.model == "GPT3 175B" else "")
        return key + (f" / {self.fp8_recipe}" if self.fp8_recipe else "")

    @property
    def dtype(self) -> str:
        return "fp8" if self.precision.upper().startswith("FP8") else "bf16"

    @property
    def moe(self) -> bool:
        return self.layout.ep > 1


def _layout(batch: list[str], layout: str) -> Layout:
    gbs, mbs, seq = (int(x) for x in batch)
    tp, pp, cp, vp, *ep = layout.split("/")
    vpp = int(vp) if vp.isdigit() and int(vp) > 1 else None
    return Layout(tp=int(tp), pp=int(pp), cp=int(cp), vpp=vpp, mbs=mbs, gbs=gbs, seq=seq, ep=int(ep[0]) if ep else 1)


def parse(text: str) -> list[Point]:
    """Every row | model | release | GPUs | precision | GBS/MBS/seq | TP/PP/CP/VP | tokens/s/GPU | (more cells may
    follow), or | ... | GBS/MBS | seq | TP/PP/CP/VP[/EP] | tokens | (the BF16 and MoE tables); VP "–" or 1: none. A
    run with a blockwise variant (_BLOCKWISE) brings a second point, "FP8 blockwise" in docs/throughput.md's copy."""
    points = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or not cells[2].isdigit():
            continue
        if cells[4].count("/") == 2:
            batch, layout, tokens = cells[4].split("/"), cells[5], cells[6]
        elif cells[4].count("/") == 1 and len(cells) >= 8 and cells[5].isdigit():
            batch, layout, tokens = [*cells[4].split("/"), cells[5]], cells[6], cells[7]
        else:
            continue
        prec, variant = cells[3], _BLOCKWISE.search(cells[3])
        recipe = "blockwise" if "blockwise" in prec and not variant else None
        point = Point(cells[0], cells[1], int(cells[2]), prec, _layout(batch, layout), float(tokens), recipe)
        if variant:  # the published TFLOP/s is the row's last cell
            point = replace(point, precision=prec.split()[0])
            tokens = round(point.tokens * int(variant[1]) / float(cells[-1]))
            blockwise = replace(point, precision=f"{point.precision} blockwise", tokens=tokens, fp8_recipe="blockwise")
        points += [point, blockwise] if variant else [point]
    return points


# The reference's scaling series (MLPerf Training GPT-3 175B, closed division): | round · submitter · system | GPUs |
# TP/PP/VP | MBS | GBS | GA | software | tokens/s/GPU | (docs/throughput.md's copy adds the prediction's cells).
_SCALING = re.compile(r"^(v\d+\.\d+) .+")
SCALING_MODEL, SCALING_SEQ = "GPT3 175B", 2048
# Runs not fitted on, each with the reference's reason (no steady step) and the step in seconds it ran at before it
# crept up (the reference's figure): the prediction, a steady step's, is judged against that step, not the average.
UNSTEADY = {
    "MLPerf v4.1 Oracle BM.GPU.H100.8 ×384 (RoCE)": ("its step time creeps up during the run (2.7 → 3.2–3.5 s)", 2.7),
}


def parse_scaling(text: str) -> list[Point]:
    """The scaling series' rows: GPT-3 175B at seq 2048, FP8, TP/PP/VP as published; the series is the round."""
    points = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 8 or not _SCALING.match(cells[0]) or not cells[1].isdigit() or cells[2].count("/") != 2:
            continue
        tp, pp, vp = (int(x) for x in cells[2].split("/"))
        mbs, gbs, ga = int(cells[3]), int(cells[4]), int(cells[5])
        lay = Layout(tp=tp, pp=pp, cp=1, vpp=vp if vp > 1 else None, mbs=mbs, gbs=gbs, seq=SCALING_SEQ)
        point = Point(SCALING_MODEL, cells[6], int(cells[1]), "FP8", lay, float(cells[7]))
        fp8_params = "FP8 params" in cells[6]
        points.append(replace(point, series=cells[0].split()[0], system=cells[0], ga=ga, fp8_params=fp8_params))
    return points


def load() -> list[Point]:
    """docs/throughput.md's copy of the reference's runs (the scaling series' last)."""
    text = DOC.read_text()
    return parse(text) + parse_scaling(text)


def recipe_of(p: Point) -> tuple[str, int, str]:
    """(recipe, nodes, SET) that plan this published run: the model's shipped recipe in that precision."""
    from overlapkit.bridge import registry

    dtype = "fp8cs" if p.dtype == "fp8" else "bf16"
    prefix = _MODELS[p.model] + "_pretrain_"
    names = [n for n in registry.names() if n.startswith(prefix) and n.endswith(f"_h100_{dtype}")]
    name = next((n for n in names if f"_{p.gpus}gpu_" in n), names[0])
    lay = p.layout
    sets = {
        "model.tensor_model_parallel_size": lay.tp,
        "model.pipeline_model_parallel_size": lay.pp,
        "model.context_parallel_size": lay.cp,
        "model.virtual_pipeline_model_parallel_size": lay.vpp,
        "train.micro_batch_size": lay.mbs,
        "train.global_batch_size": lay.gbs,
        "model.seq_length": lay.seq,
    }
    if p.moe:
        sets["model.expert_model_parallel_size"] = lay.ep
    if p.fp8_recipe == "blockwise":  # as the blockwise perf recipe
        sets["mixed_precision.fp8_recipe"] = "blockwise"
    if p.fp8_recipe == "blockwise" or (p.series and not p.fp8_params):  # no FP8 parameters, so no FP8 param gather
        sets |= {"mixed_precision.fp8_param_gather": "false", "mixed_precision.fp8_param": "false"}
    return name, p.gpus // 8, " ".join(f"{k}={'null' if v is None else v}" for k, v in sets.items())


def plan_of(p: Point):
    from overlapkit.bridge.build import make_plan

    name, nodes, sets = recipe_of(p)
    return make_plan(name, nodes=nodes, sets=sets, caller_env={})


def inputs_of(points: list[Point], plans: dict | None = None) -> dict[str, throughput.Inputs]:
    """What the model reads of each run's plan (plans: by key, planned here when not given)."""
    from overlapkit.bridge.build import prediction_inputs

    plans = plans if plans is not None else {p.key: plan_of(p) for p in points}
    return {p.key: prediction_inputs(plans[p.key]) for p in points}


def leveled(points: list[Point], raw: dict[str, float], used: set[str]) -> dict[str, float]:
    """`raw` predictions (tokens/s/GPU by key) with each scaling series' at the series' own level: times the geometric
    mean of published ÷ predicted over the series' runs in `used` (a series with none there keeps no prediction)."""
    out = {p.key: raw[p.key] for p in points if not p.series}
    for series in {p.series for p in points if p.series}:
        runs = [p for p in points if p.series == series]
        level = [math.log(p.tokens / raw[p.key]) for p in runs if p.key in used]
        for p in runs if level else ():
            out[p.key] = raw[p.key] * math.exp(statistics.fmean(level))
    return out


def refit(points: list[Point], inputs: dict, leave_out: str | None = None) -> calibration.Constants:
    """The constants fitted on every run but `leave_out`, from calibration.NEUTRAL (so a left-out run cannot reach its
    own prediction through the starting point)."""
    used = {p.key: p.tokens for p in points if p.key != leave_out and p.key not in UNSTEADY}

    def predict(k):
        return {key: v for key, v in _predicted(points, inputs, k, set(used)).items() if key in used}

    return calibration.fit(predict, used, start=calibration.NEUTRAL)


def _predicted(points: list[Point], inputs: dict, k: calibration.Constants | None, used: set[str]) -> dict:
    return leveled(points, {p.key: inputs[p.key].predict(k).tokens_per_gpu_s for p in points}, used)


def rows(points: list[Point], inputs: dict) -> list[dict]:
    """Published vs predicted per run (the fitted constants), and by the fit without that run (a scaling run: at the
    level of its round's other runs; none, no leave-one-out); for an MoE run, how it routed (the reference's MoE rows
    force-balance the load, token-dropless from 26.02 on or where the release says so) and how the recipe routes."""
    keys = {p.key for p in points} - set(UNSTEADY)
    fitted = _predicted(points, inputs, None, keys)
    out = []
    for p in points:
        pred = fitted[p.key]
        routing = "–"
        if p.moe:
            release = re.search(r"(\d+)\.(\d+)", p.release)
            dropless = "dropless" in p.release or (bool(release) and (int(release[1]), int(release[2])) >= (26, 2))
            capacity = inputs[p.key].moe.capacity
            planned = "dropless" if capacity is None else f"capacity {capacity}"
            routing = f"forced balance, {'dropless' if dropless else 'capacity'} / learned router, {planned}"
        held = _predicted(points, inputs, refit(points, inputs, p.key), keys - {p.key}).get(p.key)
        first_step = UNSTEADY.get(p.key, (None, None))[1]
        out.append(
            {
                "point": p,
                "predicted": pred,
                "error": pred / p.tokens - 1,
                "loo_error": None if held is None else held / p.tokens - 1,
                "steady_error": first_step and pred * first_step * p.gpus / (p.layout.gbs * p.layout.seq) - 1,
                "recipe": recipe_of(p)[0],
                "routing": routing,
            }
        )
    return out


def verdict(table_rows: list[dict]) -> list[str]:
    """What breaks issue #25's bar (FIT_TOL, LOO_TOL; empty: none); an UNSTEADY run is judged on its steady step (it
    is not fitted on, so its prediction is held out already)."""
    error = {r["point"].key: r["error"] if r["steady_error"] is None else r["steady_error"] for r in table_rows}
    bad = [f"{key}: {e:+.1%}" for key, e in error.items() if abs(e) > FIT_TOL]
    held = [r for r in table_rows if r["steady_error"] is None and abs(r["loo_error"] or 0) > LOO_TOL]  # None: no LOO
    return bad + [f"{r['point'].key}: leave-one-out {r['loo_error']:+.1%}" for r in held]


def table(table_rows: list[dict]) -> str:
    """The Markdown validation tables of docs/throughput.md: the runs, then the scaling series (scaling_table)."""
    lines = [
        "| model | release | GPUs | precision | GBS/MBS/seq | TP/PP/CP/VP/EP | tokens/s/GPU published | predicted "
        "| error | leave-one-out | planned as | routing (published / planned) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [r for r in table_rows if not r["point"].series]
    for r in runs:
        p, lay = r["point"], r["point"].layout
        lines.append(
            f"| {p.model} | {p.release} | {p.gpus} | {p.precision} | {lay.gbs}/{lay.mbs}/{lay.seq} "
            f"| {lay.tp}/{lay.pp}/{lay.cp}/{lay.vpp or '–'}/{lay.ep} | {p.tokens:.0f} | {r['predicted']:.0f} "
            f"| {r['error']:+.1%} | {r['loo_error']:+.1%} | `{r['recipe']}` | {r['routing']} |"
        )
    lines += ["", _spread(runs), ""]
    return "\n".join(lines) + scaling_table([r for r in table_rows if r["point"].series])


def _spread(table_rows: list[dict]) -> str:
    fit = [abs(r["error"]) for r in table_rows]
    loo = [abs(r["loo_error"]) for r in table_rows if r["loo_error"] is not None]
    return (
        f"{len(fit)} runs: |error| median {statistics.median(fit):.1%}, worst {max(fit):.1%}; leave-one-out "
        f"median {statistics.median(loo):.1%}, worst {max(loo):.1%}"
        + (f" ({len(loo)} of them)." if len(loo) < len(fit) else ".")
    )


def scaling_table(table_rows: list[dict]) -> str:
    """The scaling series' table, each run at its round's level ("–": no leave-one-out, the round's only run)."""
    if not table_rows:
        return ""
    lines = [
        "| round · submitter · system | GPUs | TP/PP/VP | MBS | GBS | GA | software | tokens/s/GPU published "
        "| predicted | error | leave-one-out |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table_rows:
        p, lay = r["point"], r["point"].layout
        loo = "–" if r["loo_error"] is None else f"{r['loo_error']:+.1%}"
        if p.key in UNSTEADY:
            loo += f" (not fitted: unsteady; {r['steady_error']:+.1%} against its first {UNSTEADY[p.key][1]} s step)"
        lines.append(
            f"| {p.system} | {p.gpus} | {lay.tp}/{lay.pp}/{lay.vpp or 1} | {lay.mbs} | {lay.gbs} | {p.ga} "
            f"| {p.release} | {p.tokens:.1f} | {r['predicted']:.1f} | {r['error']:+.1%} | {loo} |"
        )
    steady = [r for r in table_rows if r["point"].key not in UNSTEADY]
    return "\n" + "\n".join([*lines, "", _spread(steady)]) + "\n"


def bands(table_rows: list[dict]) -> dict[str, calibration.Band]:
    """The leave-one-out errors' spread by class of comparable runs (dense or MoE, precision): calibration.BANDS.
    A run's leave-one-out error on tokens/s is its measured step over the predicted one, less 1."""
    by: dict[str, list[float]] = {}
    for r in (r for r in table_rows if not r["point"].series):
        by.setdefault(calibration.kind(r["point"].moe, r["point"].dtype), []).append(r["loo_error"])
    return {
        k: calibration.Band(round(float(min(v)), 4), round(float(max(v)), 4), len(v), f"{len(v)} published {k} runs")
        for k, v in by.items()
    }


def bands_table(by_kind: dict[str, calibration.Band]) -> str:
    """docs/throughput.md's band table."""
    lines = ["| runs | leave-one-out band (measured ÷ predicted step − 1) | runs in it |", "|---|---|---|"]
    lines += [f"| {k} | {b.low:+.1%} … {b.high:+.1%} | {b.runs} |" for k, b in by_kind.items()]
    return "\n".join(lines) + "\n"


def constants_table(k: calibration.Constants = calibration.FITTED) -> str:
    """The fitted constants of docs/throughput.md, each with the runs it is fitted on."""
    lines = ["| constant | value | fitted on |", "|---|---|---|"]
    for name in calibration.NAMES:
        on = calibration.FITTED_ON[name]
        models = sorted({"the MLPerf GPT3 175B series" if r.startswith("MLPerf") else r.split(" /")[0] for r in on})
        where = ", ".join(on) if len(on) <= 3 else f"{len(on)} runs: " + ", ".join(models)
        lines.append(f"| `{name}` | {getattr(k, name):.4g} | {where} |")
    return "\n".join(lines) + "\n"
