"""The throughput model's fitted constants: their values, the published rows each is fitted on (FITTED_ON, row keys
of bridge/published.py) and the fit (`fit`: least squares in log error over those rows, within BOUNDS), which
tests/unit_tests/sizing/test_throughput.py re-runs, with a leave-one-out check of each row. Every other number of the
model is a datasheet figure (sizing/hardware.py) or a rule of the software stack.

A cluster's own calibration (`make calibrate`: `fit_free` on its runs' measured step times) is stored per cluster
under runs/calibration/ (git-ignored, never over FITTED); `for_cluster` gives it, or the published one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio, paths
from overlapkit.errors import BadInput
from overlapkit.names import checked_name, inside


@dataclass(frozen=True)
class Constants:
    gemm_bf16: float = 0.6079  # achieved fraction of the dense BF16 peak: BF16 linear layers, core attention, logits
    gemm_fp8: float = 0.4724  # achieved fraction of the dense FP8 peak: FP8 linear layers (tensorwise/delayed)
    blockwise: float = 0.9452  # blockwise (1×128 / 128×128 scaled) FP8 GEMM rate over the tensorwise one
    layer_overhead_s: float = 1.299e-3  # non-GEMM time per transformer layer per microbatch (fwd + bwd) per GPU
    layer_token_s: float = 7.558e-8  # and per token of the GPU's share of the layer (s·b/(CP·TP): elementwise work)
    moe_token_s: float = 6.726e-7  # non-GEMM time per token per MoE layer (fwd + bwd) beyond a dense layer's
    grouped_gemm: float = 0.6158  # the routed experts' grouped-GEMM rate over the dense GEMM rate of the dtype
    a2a_efficiency: float = 0.8929  # achieved fraction of the link bandwidth in the EP all-to-all
    jitter: float = 0.04626  # s: one rank's step-time spread (σ) at the step's synchronising collective

    def replace(self, **changes) -> Constants:
        return dataclasses.replace(self, **changes)


FITTED = Constants()
NAMES = tuple(f.name for f in dataclasses.fields(Constants))
# (low, high) of each: physical ranges (a fraction of a peak is in (0, 1]; a ratio of two rates is near 1).
BOUNDS = {
    "gemm_bf16": (0.2, 1.0),
    "gemm_fp8": (0.2, 1.0),
    "blockwise": (0.5, 1.5),
    "layer_overhead_s": (0.0, 5e-3),
    "layer_token_s": (0.0, 1e-6),
    "moe_token_s": (0.0, 1e-5),
    "grouped_gemm": (0.05, 1.0),
    "a2a_efficiency": (0.05, 1.0),
    "jitter": (0.0, 0.5),
}
# Where a fit has no row for a constant (a leave-one-out fit without its only row), it stays here: the rate of the
# kind it refines (blockwise: the tensorwise rate), or the middle of its range.
NEUTRAL = Constants(0.7, 0.5, 1.0, 1e-3, 1e-7, 8e-7, 0.5, 0.7, 0.05)

_DENSE_FP8 = (
    "Llama3 8B / Megatron-Bridge 25.11",
    "Llama3 70B / Megatron-Bridge 26.04.01",
    "Llama3 70B / Megatron-Bridge 25.11",
    "Llama3.1 405B / Megatron-Bridge 26.06",
    "Llama3.1 405B / Megatron-Bridge 25.11",
    "GPT3 175B / NeMo 24.07 / 128",
    "GPT3 175B / NeMo 24.07 / 512",
    "Llama3 8B / NeMo 24.07",
    "Llama3 70B / NeMo 24.07",
)
_BF16 = ("Llama3.1 8B / dgxc-benchmarking v25.04.02", "Llama3.1 405B / dgxc-benchmarking v25.04.02")
_MOE_FP8 = (
    "Qwen3 30B-A3B / Megatron-Bridge 26.06",
    "Qwen3 235B-A22B / Megatron-Bridge 26.04.01",
    "DeepSeek-V3 / Megatron-Bridge 25.09",
)
_BLOCKWISE = ("DeepSeek-V3 / Megatron-Bridge 25.09 / blockwise",)
_MOE = _MOE_FP8 + _BLOCKWISE
# The reference's scaling series (MLPerf Training GPT-3 175B, dense FP8), but its unsteady run
# (bridge/published.py UNSTEADY): fitted on their ratios within a round.
_SCALING = tuple(
    "MLPerf " + s
    for s in (
        "v3.0 NVIDIA dgxh100_n64",
        "v3.0 NVIDIA dgxh100_n96",
        "v3.0 NVIDIA+CoreWeave hgxh100_n96",
        "v3.0 NVIDIA+CoreWeave hgxh100_n192",
        "v3.0 NVIDIA+CoreWeave hgxh100_n448",
        "v3.1 NVIDIA eos_n64",
        "v3.1 NVIDIA eos_n96",
        "v3.1 NVIDIA eos-dfw_n512",
        "v3.1 NVIDIA eos-dfw_n768",
        "v3.1 NVIDIA eos-dfw_n1024",
        "v3.1 NVIDIA eos-dfw_n1280",
        "v3.1 NVIDIA eos-dfw_n1344",
        "v3.1 Azure+NVIDIA ND_H100_v5 ×1344",
        "v4.0 Sustainable Metal Cloud, 64 nodes",
        "v4.1 NVIDIA eos_n32",
        "v4.1 NVIDIA eos_n64",
        "v4.1 Oracle BM.GPU.H100.8 ×192 (RoCE)",
    )
)
# Qwen3 235B-A22B's GEMMs all run under its overlapped all-to-all (its step is the all-to-all's), so no GEMM rate
# moves its prediction.
_MOE_GEMM = tuple(k for k in _MOE if not k.startswith("Qwen3 235B"))
FITTED_ON = {
    # every run has BF16 work (core attention, the output layer); the BF16 runs have only that
    "gemm_bf16": _DENSE_FP8 + _BF16 + _MOE_GEMM + _SCALING,
    "gemm_fp8": _DENSE_FP8 + _MOE_GEMM + _SCALING,  # the blockwise rate is this one times `blockwise`
    "blockwise": _BLOCKWISE,
    "layer_overhead_s": _DENSE_FP8 + _BF16 + _MOE + _SCALING,
    "layer_token_s": _DENSE_FP8 + _BF16 + _MOE + _SCALING,
    "moe_token_s": _MOE,
    "grouped_gemm": _MOE_GEMM,
    "a2a_efficiency": _MOE,
    "jitter": _DENSE_FP8 + _BF16 + _MOE + _SCALING,  # every run has more than one independent rank
}


def fit(
    predict: Callable[[Constants], dict[str, float]], published: dict[str, float], start: Constants = FITTED
) -> Constants:
    """The constants that minimise Σ log(predicted/published)² over the rows of `published` (tokens/s/GPU by key),
    each within BOUNDS: scipy's bounded least squares (trust-region reflective) on the constants scaled to their
    start. A constant that none of the rows moves stays at NEUTRAL. `predict(constants)` gives tokens/s/GPU by key."""
    free = [n for n in NAMES if set(FITTED_ON[n]) & set(published)]
    base = start.replace(**{n: getattr(NEUTRAL, n) for n in NAMES if n not in free})
    return fit_free(predict, published, free, base)


def fit_free(
    predict: Callable[[Constants], dict[str, float]], measured: dict[str, float], free: list[str], base: Constants
) -> Constants:
    """`base` with the constants named in `free` set to minimise Σ log(predicted/measured)² over the keys of
    `measured` (any quantity proportional to throughput or to step time, the same in both), within BOUNDS."""
    from scipy.optimize import least_squares

    keys = sorted(measured)
    scale = [getattr(NEUTRAL, n) for n in free]

    def of(x) -> Constants:
        return base.replace(**{n: v * s for n, v, s in zip(free, x, scale, strict=True)})

    def residuals(x):
        got = predict(of(x))
        return [math.log(got[k] / measured[k]) for k in keys]

    lo = [BOUNDS[n][0] / s for n, s in zip(free, scale, strict=True)]
    hi = [BOUNDS[n][1] / s for n, s in zip(free, scale, strict=True)]
    x0 = [min(max(getattr(base, n) / s, a), b) for n, s, a, b in zip(free, scale, lo, hi, strict=True)]
    return of(least_squares(residuals, x0, bounds=(lo, hi), xtol=1e-10, ftol=1e-10, diff_step=1e-4).x)


def rounded(k: Constants) -> Constants:
    """Four significant digits: what FITTED keeps of a fit."""
    return Constants(*(float(f"{getattr(k, n):.4g}") for n in NAMES))


# --- error bands and per-cluster calibrations -------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """The spread of leave-one-out errors (predicted/measured − 1, on step time) of comparable runs: a run like them
    should take between step·(1 + low) and step·(1 + high)."""

    low: float
    high: float
    runs: int
    of: str  # which runs: "4 published MoE fp8 runs"

    def to_dict(self) -> dict:
        return {"low": round(self.low, 4), "high": round(self.high, 4), "runs": self.runs, "of": self.of}


def kind(moe: bool, dtype: str) -> str:
    """The class of comparable runs a band is taken over: dense or MoE, and the precision."""
    return f"{'MoE' if moe else 'dense'} {dtype}"


# Leave-one-out errors on step time of the published runs by class (bridge/published.py `bands`, checked by
# tests/unit_tests/sizing/test_throughput.py): min and max over the class's runs.
BANDS = {
    "dense fp8": Band(-0.1175, 0.0997, 9, "9 published dense fp8 runs"),
    "dense bf16": Band(-0.105, 0.1131, 2, "2 published dense bf16 runs"),
    "MoE fp8": Band(-0.0801, 0.1083, 4, "4 published MoE fp8 runs"),
}


@dataclass(frozen=True)
class Calibration:
    """The constants a prediction uses, what to call them, and the bands of their errors."""

    constants: Constants = FITTED
    label: str = "published"  # or "<cluster> fitted on N runs on <date>"
    bands: dict = field(default_factory=lambda: dict(BANDS))  # {kind: Band}
    kept: tuple[str, ...] = ()  # constants the cluster's runs could not move: published values

    def band(self, moe: bool, dtype: str) -> Band:
        """This calibration's band for the kind, else the published one, else the widest published band of the same
        family (dense or MoE) with what it is said."""
        want = kind(moe, dtype)
        if band := self.bands.get(want) or BANDS.get(want):
            return band
        family = [b for k, b in BANDS.items() if k.split()[0] == want.split()[0]] or list(BANDS.values())
        low, high = min(b.low for b in family), max(b.high for b in family)
        runs = sum(b.runs for b in family)
        return Band(low, high, runs, f"no {want} run: {runs} published {want.split()[0]} runs of other precisions")


PUBLISHED = Calibration()
# Where make calibrate writes a cluster's fit: runs/calibration (paths.runs_root(), git-ignored, like the run
# directories); OVERLAPKIT_CALIBRATION_DIR elsewhere (a test's own directory).
DIR_VAR = "OVERLAPKIT_CALIBRATION_DIR"
FIX = "run make calibrate CLUSTER=<name> again, or delete the file to predict with the published constants"
# The largest leave-one-out error (predicted/measured − 1, either way) a calibration may have on any of its runs, and
# so the widest band it may hold: the published fit's worst is 12% (BANDS); a run the fitted model misses by half its
# step is one the model cannot explain (another job's log, a broken node), and a band that wide predicts nothing.
MAX_ERROR = 0.5


# The constants whose larger value makes a step slower (times per layer and per token); the others are rates. At the
# BOUNDS corners they give the fastest and the slowest step any physical calibration can predict for a plan.
SLOWER = ("layer_overhead_s", "layer_token_s", "moe_token_s", "jitter")
FASTEST = Constants(**{n: BOUNDS[n][0] if n in SLOWER else BOUNDS[n][1] for n in NAMES})
SLOWEST = Constants(**{n: BOUNDS[n][1] if n in SLOWER else BOUNDS[n][0] for n in NAMES})


def beyond_physics(step_s: Callable[[Constants], float], measured_s: float) -> str | None:
    """Why a measured step time cannot be fitted (one phrase), or None: no constants within BOUNDS bring the plan's
    predicted step (`step_s(constants)`) within MAX_ERROR of it, so no fit can explain it (a log of another job, or a
    clock that is not one)."""
    fast, slow = step_s(FASTEST), step_s(SLOWEST)
    if math.isfinite(measured_s) and fast * (1 - MAX_ERROR) <= measured_s <= slow * (1 + MAX_ERROR):
        return None
    return (
        f"its log's step time {measured_s:.4g} s is outside {fast:.3g}–{slow:.3g} s, what its plan takes at any "
        f"physical value of the constants (BOUNDS, ±{MAX_ERROR:.0%}): not a step of this plan"
    )


def folder(root: Path | None = None) -> Path:
    return Path(root or os.environ.get(DIR_VAR) or paths.runs_root() / "calibration")


def path_of(cluster: str, root: Path | None = None) -> Path:
    """runs/calibration/<cluster>.json; BadInput for a name that would put it anywhere else (a `/`, `../`, an
    absolute path): what is read or written here is only ever a file directly in that folder (the one rule for
    names: overlapkit.names). A write also resolves it inside the folder first (save: a link planted there)."""
    fix = "name the profile with letters, digits, _ . - only: its calibration is a file in runs/calibration"
    return folder(root) / (checked_name(cluster, "cluster name", fix) + ".json")


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a number")
    return float(value)


def _band(kind_: str, b) -> Band:
    if not isinstance(b, dict):
        raise ValueError(f"bands.{kind_} is {b!r}, not an object")
    runs = b.get("runs")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2 or not isinstance(b.get("of"), str):
        raise ValueError(f"bands.{kind_} has runs={runs!r}, of={b.get('of')!r}: not a count ≥ 2 and a description")
    low, high = (_number(b.get(k), f"bands.{kind_}.{k}") for k in ("low", "high"))
    return Band(low, high, runs, b["of"])


def problem(cal: Calibration) -> str | None:
    """What makes `cal` unusable (one phrase), or None: a constant outside its physical range (BOUNDS), a band that
    is not a finite low ≤ high within ±MAX_ERROR. The one rule make calibrate writes by and make plan reads by."""
    for n in NAMES:
        lo, hi = BOUNDS[n]
        value = getattr(cal.constants, n)
        if not (math.isfinite(value) and lo <= value <= hi):
            return f"{n}={value} is outside its physical range [{lo}, {hi}]"
    for k, b in cal.bands.items():
        if not (math.isfinite(b.low) and math.isfinite(b.high) and -MAX_ERROR <= b.low <= b.high <= MAX_ERROR):
            return f"band {k} {b.low:+.1%}…{b.high:+.1%} is not a spread within ±{MAX_ERROR:.0%} (low ≤ high)"
    if bad := [n for n in cal.kept if n not in NAMES]:
        return f"kept names {', '.join(map(repr, bad))}, not constants of the model"
    return None


def for_cluster(cluster: str | None, root: Path | None = None) -> Calibration:
    """The calibration make calibrate wrote for `cluster`, or the published one where it wrote none; BadInput (one
    line naming the file and the fix) for a file that is not a usable calibration (problem)."""
    if not cluster:
        return PUBLISHED
    path = path_of(cluster, root)
    role = "make calibrate's fit for cluster " + cluster
    data = jsonio.read_json(path, role=role, fix=FIX, keys=("label", "constants", "bands"), missing_ok=True)
    if data is None:
        return PUBLISHED
    try:
        if not isinstance(data["constants"], dict) or not isinstance(data["bands"], dict):
            raise ValueError("constants and bands are not objects")
        constants = FITTED.replace(**{n: _number(data["constants"].get(n), f"constants.{n}") for n in NAMES})
        bands = {str(k): _band(k, b) for k, b in data["bands"].items()}
        kept = data.get("kept", [])
        if not isinstance(kept, list) or not all(isinstance(n, str) for n in kept):
            raise ValueError(f"kept is {kept!r}, not a list of names")
        if data.get("cluster", cluster) != cluster:
            raise ValueError(f"it is cluster {data['cluster']!r}'s")
        if not (isinstance(data["label"], str) and data["label"].isprintable() and len(data["label"]) <= 200):
            raise ValueError(f"label is {str(data['label'])[:40]!r}, not one line of text")
        cal = Calibration(constants, data["label"], bands, tuple(kept))
        if why := problem(cal):
            raise ValueError(why)
    except ValueError as exc:
        raise BadInput(f"{path}: {exc}; it should be {role}: {FIX}") from None
    return cal


def save(cluster: str, cal: Calibration, runs: list[dict], root: Path | None = None) -> Path:
    """Write `cal` as `cluster`'s calibration (with the runs it was fitted on) under runs/calibration/, after the
    same checks make plan reads it by (problem: an unusable fit is refused, the file there kept); BadInput naming the
    folder when it cannot be written."""
    path = inside(folder(root), path_of(cluster, root).name)  # written only inside runs/calibration, links resolved
    if why := problem(cal):
        raise BadInput(f"fit refused, {path} left as it was: {why}; check the runs it was fitted on (make calibrate)")
    data = {
        "cluster": cluster,
        "label": cal.label,
        "constants": {n: getattr(cal.constants, n) for n in NAMES},
        "kept": list(cal.kept),
        "bands": {k: b.to_dict() for k, b in cal.bands.items()},
        "runs": runs,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return jsonio.write_json(path, data)
    except OSError as exc:
        raise BadInput(f"{path} cannot be written ({exc.strerror or exc}): make {path.parent} writable") from None
