"""Nightly comparison rules: a parsed run (logparse) + Slurm's verdict + the recipe's golden → one status.

Goldens live in `nightly/goldens/<recipe>.json` and come only from `make bless RUN=<reviewed run>`: no number here
is invented. Rules, in the order they are applied (the first that fires decides):

1. Hard failures, never retried (retrying hides them, and they reproduce): NaN/inf loss or grad norm, CUDA illegal
   memory access, NCCL watchdog timeout, CUDA OOM, a job that died before iteration 1.
2. Infrastructure failures (Slurm state NODE_FAIL/PREEMPTED, or slurmstepd's banner in the log): one retry.
3. Preflight-only runs (no training on a CPU machine): the preflight's result, no numbers.
4. Any other non-COMPLETED state (FAILED, TIMEOUT, CANCELLED): failure.
5. Against the golden, after warm-up: step time and TFLOP/s/GPU within ±5 %, peak memory within ±5 %, loss within
   the tiered tolerance below. Beyond tolerance in the *good* direction is a failure too ("unexpected improvement"):
   on a fixed shape and seed a faster run almost always means a knob changed (an overlap, a fused kernel, the
   batch shape), so the golden no longer describes the recipe until someone reviews and re-blesses.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlapkit import jsonio, stack

GOLDENS_DIR = stack.REPO_ROOT / "nightly" / "goldens"
PERF_TOL = 0.05  # ±5 %: H100 run-to-run step-time noise on a fixed shape is ~1-2 %; 5 % catches one lost overlap
MEM_TOL = 0.05
# Loss tolerance per iteration, relative to the golden loss: (up to iteration, tolerance). Looser early: in the first
# iterations the loss falls steeply (≈ ln(vocab) ≈ 11.8 toward 7-8) while the LR warms up, so a tiny numeric
# difference (non-deterministic NCCL/cuBLAS reduction order, FP8 amax history) moves a point on a steep slope a long
# way; later the curve is flat and the same drift is small, so a sustained offset there is a real numerics change
# (precision recipe, init, data order). Starting values: recalibrate from the spread of >= 3 blessed runs.
LOSS_TIERS = ((10, 0.03), (30, 0.015), (10**9, 0.0075))
GOLDEN_LOSS_ITERS = 100
HARD_EVENTS = ("illegal_memory_access", "nccl_watchdog_timeout", "cuda_oom")
INFRA_STATES = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
INFRA_EVENTS = ("node_fail", "preempted")
MAX_RETRIES = 1
NO_GOLDEN = "no golden yet: bless a reviewed run"
# What a nightly run is, so a golden and a night compare like with like (nightly.shape_for applies them).
NIGHTLY_ITERS = 60  # 10 warm-up + 50 steady iterations: enough for a ±5 % step-time mean and a loss curve's knee
NIGHTLY_SEED = 1234


class BlessError(ValueError):
    """One-line, user-facing."""


@dataclass
class Verdict:
    status: str  # pass | regression | unexpected_improvement | hard_failure | infra_retry | infra_failure |
    #              no_golden | preflight_only | preflight_failed | failed
    reasons: list[str] = field(default_factory=list)
    retry: bool = False
    checks: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "no_golden", "preflight_only")

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def loss_tolerance(iteration: int) -> float:
    return next(tol for upto, tol in LOSS_TIERS if iteration <= upto)


def load_golden(recipe: str, goldens_dir: Path = GOLDENS_DIR) -> dict | None:
    path = Path(goldens_dir) / f"{recipe}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _rel(value, golden) -> float | None:
    if value is None or golden in (None, 0):
        return None
    return (value - golden) / golden


def compare(parsed: dict, golden: dict) -> list[dict]:
    """One check per metric: value, golden, relative delta, and 'ok' | 'worse' | 'better'."""
    s, checks = parsed["summary"], []
    # (name, run value, golden value, sign: +1 when larger is worse)
    for name, sign, tol in (("step_time_ms", +1, PERF_TOL), ("tflops_per_gpu", -1, PERF_TOL),
                            ("peak_mem_gb", +1, MEM_TOL)):  # fmt: skip
        value, gold = s.get(name), golden.get(name)
        if gold is None:
            continue
        d = _rel(value, gold)
        verdict = "missing" if d is None else "ok" if abs(d) <= tol else "worse" if d * sign > 0 else "better"
        checks.append({"metric": name, "value": value, "golden": gold, "delta": d, "tol": tol, "verdict": verdict})
    gold_loss = {int(k): v for k, v in (golden.get("loss") or {}).items()}
    run_loss = {r["iteration"]: r.get("lm_loss") for r in parsed["iterations"]}
    worst = None
    for it, gl in sorted(gold_loss.items()):
        if it not in run_loss:
            continue
        rl = run_loss[it]
        d = _rel(rl, gl) if rl is not None and math.isfinite(rl) else math.inf
        margin = abs(d) / loss_tolerance(it)
        if worst is None or margin > worst[0]:
            worst = (margin, it, rl, gl, d)
    missing = [it for it in gold_loss if it not in run_loss]
    if worst is not None:
        margin, it, rl, gl, d = worst
        verdict = "ok" if margin <= 1 else "drift"
        checks.append({"metric": "lm_loss", "value": rl, "golden": gl, "delta": d, "tol": loss_tolerance(it),
                       "iteration": it, "verdict": verdict, "missing_iterations": len(missing)})  # fmt: skip
    return checks


def classify(parsed: dict | None, slurm_state: str, golden: dict | None, *, preflight_only: bool = False,
             preflight_ok: bool | None = None, attempt: int = 0) -> Verdict:  # fmt: skip
    state = (slurm_state or "UNKNOWN").split()[0].rstrip("+")
    s = parsed["summary"] if parsed else {"iterations": 0, "nan_iterations": 0}
    events = parsed.get("events", {}) if parsed else {}
    hard = [f"{e}: {events[e]}" for e in HARD_EVENTS if e in events]
    if s.get("nan_iterations"):
        hard.insert(0, f"NaN/inf loss or grad norm in {s['nan_iterations']} iteration(s)")
    if hard:
        return Verdict("hard_failure", hard)
    infra = [f"Slurm state {state}"] if state in INFRA_STATES else []
    infra += [f"{e}: {events[e]}" for e in INFRA_EVENTS if e in events]
    if infra:
        if attempt < MAX_RETRIES:
            return Verdict("infra_retry", infra + ["infrastructure failure: retried once"], retry=True)
        return Verdict("infra_failure", infra + [f"still failing after {attempt} retry"])
    if preflight_only:
        if state == "COMPLETED" and preflight_ok:
            return Verdict("preflight_only", ["preflight only — no training on this machine"])
        return Verdict("preflight_failed", [f"preflight did not pass (Slurm state {state})"])
    if not s.get("iterations"):
        return Verdict("hard_failure", [f"no training iteration was logged (Slurm state {state})"])
    if state != "COMPLETED":
        return Verdict("failed", [f"Slurm state {state} after {s['iterations']} iteration(s)"])
    if golden is None:
        return Verdict("no_golden", [NO_GOLDEN])
    checks = compare(parsed, golden)
    worse = [c for c in checks if c["verdict"] in ("worse", "drift", "missing")]
    better = [c for c in checks if c["verdict"] == "better"]
    reasons = [_describe(c) for c in worse + better]
    if worse:
        return Verdict("regression", reasons, checks=checks)
    if better:
        return Verdict(
            "unexpected_improvement", reasons + ["a knob likely changed: review, then re-bless"], checks=checks
        )
    return Verdict("pass", [], checks=checks)


def _describe(c: dict) -> str:
    if c["verdict"] == "missing":
        return f"{c['metric']}: not in the log (golden {c['golden']:.4g})"
    at = f" at iteration {c['iteration']}" if "iteration" in c else ""
    return f"{c['metric']}{at}: {c['value']:.4g} vs golden {c['golden']:.4g} ({c['delta']:+.1%}, tol ±{c['tol']:.1%})"


def make_golden(parsed: dict, plan: dict, meta: dict) -> dict:
    """The golden for a reviewed run (see bless)."""
    s = parsed["summary"]
    losses = {str(r["iteration"]): r["lm_loss"] for r in parsed["iterations"] if "lm_loss" in r}
    return {
        "recipe": plan["recipe"],
        "blessed_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "blessed_from": meta.get("run_dir"),
        "versions": meta.get("versions", {}),
        "container_image": meta.get("container_image"),
        "layout": plan["layout"],
        "overrides": plan.get("overrides", []),
        "warmup_skipped": s["warmup_skipped"],
        "step_time_ms": s["step_time_ms"],
        "tflops_per_gpu": s["tflops_per_gpu"],
        "peak_mem_gb": s["peak_mem_gb"],
        "loss": dict(list(losses.items())[:GOLDEN_LOSS_ITERS]),
    }


def bless(run_dir: Path, parsed: dict, goldens_dir: Path = GOLDENS_DIR) -> Path:
    """Write nightly/goldens/<recipe>.json from a reviewed run; refuse anything that is not a clean training run."""
    run_dir = Path(run_dir)
    if not (run_dir / "plan.json").is_file():
        raise BlessError(f"{run_dir}: no plan.json — give RUN=<a run directory from make nightly>")
    plan = json.loads((run_dir / "plan.json").read_text())
    meta_file = run_dir / "nightly.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    meta["run_dir"] = str(run_dir)
    if meta.get("preflight_only"):
        raise BlessError(f"{run_dir}: a preflight-only run has no iterations to bless; bless a GPU training run")
    if not parsed["summary"]["iterations"] or parsed["summary"]["step_time_ms"] is None:
        raise BlessError(f"{run_dir}: no training iterations in the log; nothing to bless")
    v = classify(parsed, "COMPLETED", None)
    if v.status == "hard_failure":
        raise BlessError(f"{run_dir}: refusing to bless a run with a hard failure: {v.reasons[0]}")
    goldens_dir.mkdir(parents=True, exist_ok=True)
    out = Path(goldens_dir) / f"{plan['recipe']}.json"
    jsonio.write_json(out, make_golden(parsed, plan, meta))
    return out
