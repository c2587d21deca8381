"""Nightly comparison rules: a parsed run (logparse) + Slurm's verdict + the recipe's golden → one status.

Goldens (`nightly/goldens/<recipe>.json`) come only from `make bless RUN=<reviewed run>` (bless_checks: plan, log
and Slurm state must agree). Rules, in the order they are applied (the first that fires decides):

1. Hard failures, never retried (retrying hides them, and they reproduce): NaN/inf loss or grad norm, CUDA illegal
   memory access, NCCL watchdog timeout, CUDA OOM, a job that died before iteration 1.
2. Infrastructure failures (Slurm state NODE_FAIL/PREEMPTED, or slurmstepd's banner in the log): one retry.
3. Preflight-only runs (no training on a CPU machine): the preflight's result, no numbers.
4. Any other non-COMPLETED state (FAILED, TIMEOUT, CANCELLED): failure.
5. Against the golden, after warm-up and without the profiled iterations: step time, TFLOP/s/GPU and peak memory
   within ±5 %, loss within the tiered tolerance below. Beyond tolerance in the *good* direction fails too
   ("unexpected improvement"): on a fixed shape and seed a faster run almost always means a knob changed, so the
   golden no longer describes the recipe until someone reviews and re-blesses.
6. Exposed communication per overlap class against the golden's shares (nightly/exposed.py: its margin and why).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlapkit import jsonio, names, paths
from overlapkit.errors import BadInput
from overlapkit.nightly import exposed
from overlapkit.spec import planfile

GOLDENS_DIR = paths.REPO_ROOT / "nightly" / "goldens"
PERF_TOL = 0.05  # ±5 %: H100 run-to-run step-time noise on a fixed shape is ~1-2 %; 5 % catches one lost overlap
MEM_TOL = 0.05
# Loss tolerance relative to the golden loss: (up to iteration, tolerance). Looser early, where the loss falls steeply
# (≈ ln(vocab) ≈ 11.8 toward 7-8) and a tiny numeric difference (reduction order, FP8 amax history) moves a point a
# long way; on the later flat curve a sustained offset is a real numerics change. Recalibrate from >= 3 blessed runs.
LOSS_TIERS = ((10, 0.03), (30, 0.015), (10**9, 0.0075))
GOLDEN_LOSS_ITERS = 100
HARD_EVENTS = ("illegal_memory_access", "nccl_watchdog_timeout", "cuda_oom")
INFRA_STATES = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
INFRA_EVENTS = ("node_fail", "preempted")
MAX_RETRIES = 1
NO_GOLDEN = "no golden yet: bless a reviewed run"
# An overlap's predicted worth (sizing/worth.py) names a slowdown only when the two agree within this factor either
# way: a worth is the difference of two predictions each up to 12% off (leave-one-out, docs/throughput.md), so only
# the magnitude is asked to match; beyond it no overlap is named rather than a wrong one.
WORTH_MATCH = 1.5
# A run whose step time is beyond its plan's band (plan.json throughput.band, sizing/calibration.py) stands out,
# golden or not: slower is "under prediction", faster means the calibration no longer describes the cluster. A
# plan.json from before the band: 20% under the predicted throughput, the rule it replaces.
UNDER_PREDICTION = 0.20


def beyond_band(pred_ms: float, measured_ms: float, band: dict | None) -> str | None:
    """ "under" when the measured step is longer than the band lets the predicted one be (measured/predicted − 1 above
    its high edge), "over" when shorter (below its low edge), else None."""
    ratio = measured_ms / pred_ms - 1
    high = band["high"] if band else 1 / (1 - UNDER_PREDICTION) - 1  # 20% fewer tokens/s = a 25% longer step
    if ratio > high:
        return "under"
    return "over" if band and ratio < band["low"] else None


# What a nightly run is, so a golden and a night compare like with like (nightly.shape_for applies them).
NIGHTLY_ITERS = 60  # 10 warm-up + 50 steady iterations: enough for a ±5 % step-time mean and a loss curve's knee
NIGHTLY_SEED = 1234


class BlessError(BadInput):
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


GOLDEN_ROLE = "a golden that make bless writes"
GOLDEN_KEYS = ("recipe", "step_time_ms", "layout")  # what every golden make_golden writes holds


def load_golden(recipe: str, goldens_dir: Path = GOLDENS_DIR) -> dict | None:
    """nightly/goldens/<recipe>.json; None before the first bless; one line naming the file for one that cannot be
    read or is not a golden (planted, edited, cut short)."""
    fix = "restore it from git, or bless a reviewed run over it (make bless RUN=<run dir> FORCE=1)"
    path = names.inside(goldens_dir, names.checked_name(recipe, "recipe") + ".json")
    return jsonio.read_json(path, role=GOLDEN_ROLE, fix=fix, keys=GOLDEN_KEYS, missing_ok=True)


def _rel(value, golden) -> float | None:
    if value is None or golden in (None, 0):
        return None
    return (value - golden) / golden


def compare(parsed: dict, golden: dict) -> list[dict]:
    """One check per metric: value, golden, relative delta, and 'ok' | 'worse' | 'better'."""
    s, checks = parsed["summary"], []
    for name, sign, tol in (  # sign: +1 when larger is worse
        ("step_time_ms", +1, PERF_TOL),
        ("tflops_per_gpu", -1, PERF_TOL),
        ("peak_mem_gb", +1, MEM_TOL),
    ):
        value, gold = s.get(name), golden.get(name)
        if gold is None:
            continue
        d = _rel(value, gold)
        verdict = "missing" if d is None else "ok" if abs(d) <= tol else "worse" if d * sign > 0 else "better"
        checks.append({"metric": name, "value": value, "golden": gold, "delta": d, "tol": tol, "verdict": verdict})
    gold_loss = {int(k): v for k, v in (golden.get("loss") or {}).items()}
    run_loss = {r["iteration"]: r.get("lm_loss") for r in parsed["iterations"]}
    both = [(it, gl, run_loss[it]) for it, gl in sorted(gold_loss.items()) if it in run_loss]
    deltas = [(it, gl, rl, _rel(rl, gl) if rl is not None and math.isfinite(rl) else math.inf) for it, gl, rl in both]
    if deltas:  # the iteration furthest beyond its tolerance (the first of equals)
        it, gl, rl, d = max(deltas, key=lambda x: abs(x[3]) / loss_tolerance(x[0]))
        verdict = "ok" if abs(d) / loss_tolerance(it) <= 1 else "drift"
        check = {"metric": "lm_loss", "value": rl, "golden": gl, "delta": d, "tol": loss_tolerance(it), "iteration": it}
        checks.append(check | {"verdict": verdict, "missing_iterations": len(gold_loss) - len(deltas)})
    return checks


def classify(
    parsed: dict | None,
    slurm_state: str,
    golden: dict | None,
    *,
    preflight_only: bool = False,
    preflight_ok: bool | None = None,
    attempt: int = 0,
    overlap: tuple[dict | None, str | None] = (None, None),
    worth: dict | None = None,
) -> Verdict:
    """`overlap`: exposed.read's pair for the run (rule 6). `worth`: plan.json's throughput.overlap_worth, to say
    which overlap a slower step looks like."""
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
    checks = compare(parsed, golden) + exposed.compare(*overlap, golden)
    worse = [c for c in checks if c["verdict"] in ("worse", "drift", "missing")]
    better = [c for c in checks if c["verdict"] == "better"]
    reasons = [_describe(c) for c in worse + better]
    slower = next((c for c in worse if c["metric"] == "step_time_ms" and c["verdict"] == "worse"), None)
    if slower and (hint := likely_overlap(worth, (slower["value"] - slower["golden"]) / 1e3)):
        reasons.append(f"the step time's rise {hint}")
    if worse:
        return Verdict("regression", reasons, checks=checks)
    if better:
        reasons.append("a knob likely changed: review, then re-bless")
        return Verdict("unexpected_improvement", reasons, checks=checks)
    return Verdict("pass", [], checks=checks)


def likely_overlap(worth: dict | None, slowdown_s: float) -> str | None:
    """Which overlap a step `slowdown_s` seconds slower than expected looks like: among plan.json's overlap_worth,
    the one whose predicted worth is nearest (by ratio) within WORTH_MATCH, else None."""
    if slowdown_s <= 0:
        return None
    fits = [(abs(math.log(slowdown_s / v["delta_s"])), v) for v in (worth or {}).values() if v.get("delta_s", 0) > 0]
    distance, v = min(fits, key=lambda f: f[0], default=(math.inf, None))
    if distance > math.log(WORTH_MATCH):
        return None
    return (
        f"(+{slowdown_s:.3g} s/step) looks like {v['row']} off: the plan predicts +{v['delta_s']:.3g} s/step "
        f"(+{v['delta_pct']:.1f}%) without it"
    )


def _describe(c: dict) -> str:
    if "text" in c:  # rule 6's checks say themselves what they found (nightly/exposed.py)
        return c["text"]
    if c["verdict"] == "missing":
        return f"{c['metric']}: not in the log (golden {c['golden']:.4g})"
    at = f" at iteration {c['iteration']}" if "iteration" in c else ""
    return f"{c['metric']}{at}: {c['value']:.4g} vs golden {c['golden']:.4g} ({c['delta']:+.1%}, tol ±{c['tol']:.1%})"


def make_golden(parsed: dict, plan: dict, meta: dict, overlap: dict | None = None) -> dict:
    """The golden for a reviewed run (see bless); `overlap`: its overlap report, whose exposed shares rule 6
    compares later nights with (null: the run was not profiled)."""
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
        **{key: s[key] for key in ("warmup_skipped", "step_time_ms", "tflops_per_gpu", "peak_mem_gb")},
        "loss": dict(list(losses.items())[:GOLDEN_LOSS_ITERS]),
        "excluded_iterations": s.get("excluded_iterations", []),
        "exposed_share": exposed.shares(overlap),
    }


def bless_checks(plan: dict, parsed: dict, state: str | None, meta: dict) -> list[str]:
    """Why this run may not become a golden, one reason each naming its fix (empty: it may): plan, log and Slurm must
    describe one training run. state: the job's Slurm state (None: no job known); meta: nightly.json (if any) with
    job_id (from submission.json) and preflight_only."""
    out = []
    if meta.get("preflight_only"):
        out.append("it is a preflight-only run (no training ran): bless a training run (PREFLIGHT unset)")
    job = meta.get("job_id")
    if not job:
        out.append(
            "no submission.json, so Slurm cannot say the job COMPLETED: bless a run submitted by make submit "
            "or make nightly"
        )
    elif (state or "UNKNOWN").split()[0].rstrip("+") != "COMPLETED":
        out.append(f"Slurm job {job} is {state or 'UNKNOWN'}, not COMPLETED: bless a run whose job completed")
    s, stated = parsed["summary"], parsed.get("launch") or {}  # what the log says of its launch
    if not s["iterations"] or s["step_time_ms"] is None:
        return out + [
            "no training iterations in the log; nothing to bless: bless a run whose log has Bridge's "
            "`iteration N/M |` lines"
        ]
    v = classify(parsed, "COMPLETED", None)
    if v.status == "hard_failure":
        out.append(f"refusing a run with a hard failure: {v.reasons[0]}; bless a clean run")
    out += launch_disagreements(plan, stated)
    if meta.get("recipe") not in (None, plan.get("recipe")):
        out.append(
            f"nightly.json's recipe {meta['recipe']} != plan.json's {plan.get('recipe')}: the run directory "
            "was assembled by hand; bless the directory make nightly wrote"
        )
    if s["peak_mem_gb"] is None:
        out.append(
            "no peak memory in the log (Bridge's `[Rank N] (after K iterations) memory (GB)` report): bless a "
            "run whose log has it"
        )
    return out


def launch_disagreements(plan: dict, stated: dict, verb: str = "bless") -> list[str]:
    """Where the log's launch facts (logparse's `launch`) disagree with plan.json, one reason each, its fix said with
    `verb` ("bless", "fit"): make bless refuses such a run, make calibrate skips it. Bridge prints the global batch
    size on every iteration line, so a log without it is not Bridge's; the world size and recipe where stated."""
    lay = plan.get("layout") or {}
    out = _disagreement("global batch size", stated.get("global_batch_sizes"), lay.get("gbs"), verb, required=True)
    out += _disagreement("world size", stated.get("world_sizes"), lay.get("gpus"), verb)
    return out + _disagreement("recipe", stated.get("recipes"), plan.get("recipe"), verb)


def _disagreement(what: str, stated: list | None, planned, verb: str, required: bool = False) -> list[str]:
    """The log's values of `what` against the plan's one (a log mixing two runs states two)."""
    if not stated:
        return [f"the log states no {what}: {verb} a run whose log is Bridge's own"] if required else []
    if planned is None:
        return [f"plan.json has no {what} to compare with the log's: {verb} a run planned by this version"]
    if any(v != planned for v in stated):
        return [
            f"the log's {what} {', '.join(map(str, stated))} != the plan's {planned}: the log is not this "
            f"plan's run; {verb} the run directory the log came from"
        ]
    return []


def bless(
    run_dir: Path,
    parsed: dict,
    goldens_dir: Path = GOLDENS_DIR,
    *,
    state: str | None = None,
    submission: dict | None = None,
    force: bool = False,
) -> Path:
    """Write nightly/goldens/<recipe>.json from a reviewed run when bless_checks has nothing against it; else a
    one-line BlessError with every reason. A file already there is replaced only with `force` (FORCE=1); without,
    one line saying what the new golden would change (replace_problem)."""
    run_dir = Path(run_dir)
    plan = planfile.read_plan(run_dir)  # missing or broken: one line naming the file, the field and the fix
    role = "the run's nightly record that make nightly writes"
    fix = "give RUN=<a run directory written by make nightly or make submit>"
    try:  # none: a run of make submit; one that is there must be an object (jsonio's rule)
        meta = jsonio.read_json(run_dir / "nightly.json", role=role, fix=fix, missing_ok=True) or {}
    except jsonio.FileProblem as exc:
        raise BlessError(str(exc)) from None
    # make submit records PREFLIGHT= in submission.json; older runs only in the job's launch command, the task script
    # nemo_run keeps (<experiment_dir>/<task>/scripts/<task>.sh)
    exp = (submission or {}).get("experiment_dir")
    scripts = sorted(Path(exp).glob("*/scripts/*.sh")) if exp else []
    meta["run_dir"] = str(run_dir)
    meta["job_id"] = (submission or {}).get("job_id")
    said = bool(meta.get("preflight_only") or (submission or {}).get("preflight_only"))
    meta["preflight_only"] = said or any(b"--preflight-only" in _script(p) for p in scripts)
    problems = bless_checks(plan, parsed, state, meta)
    overlap, why = exposed.read(run_dir)
    if problem := exposed.bless_problem(run_dir, plan, overlap, why, meta["preflight_only"]):
        problems.append(problem)
    if problems:
        raise BlessError(f"{run_dir}: not blessed: " + "; ".join(problems))
    Path(goldens_dir).mkdir(parents=True, exist_ok=True)
    recipe = names.checked_name(plan["recipe"], f"{run_dir}/plan.json: recipe")
    out, golden = names.inside(goldens_dir, f"{recipe}.json"), make_golden(parsed, plan, meta, overlap)
    if not force and (replaced := replace_problem(out, golden)):
        raise BlessError(f"{replaced}: make bless RUN={run_dir} FORCE=1 replaces it")
    return jsonio.write_json(out, golden)


def _script(path: Path) -> bytes:
    """A task script nemo_run kept, read guarded (b"" for one that cannot be: it states nothing)."""
    try:
        return jsonio.read_bytes(path)
    except (jsonio.Unreadable, FileNotFoundError):
        return b""


def replace_problem(out: Path, golden: dict) -> str | None:
    """Why writing `golden` at `out` needs FORCE=1 (None: nothing is there): a golden is already there (what the new
    one changes, figure by figure), or a file that is no golden of make bless (never replaced unasked)."""
    if not out.exists() and not out.is_symlink():
        return None
    try:
        old = jsonio.read_json(out, role=GOLDEN_ROLE, keys=GOLDEN_KEYS)
    except jsonio.FileProblem as exc:
        return f"{str(exc).partition('; it should be')[0]}, not {GOLDEN_ROLE}: not replaced"
    changes = golden_changes(old, golden)
    when = f"blessed from {old.get('blessed_from')} at {old.get('blessed_at')}"
    return f"{out} is already {golden['recipe']}'s golden ({when}); " + (
        f"this run changes {', '.join(changes)}" if changes else "this run changes none of its figures"
    )


def golden_changes(old: dict, new: dict) -> list[str]:
    """What `new` changes against the golden `old`, one phrase per figure: the step time, TFLOP/s, peak memory, the
    loss at the last iteration both hold, the exposed share per class, the layout."""
    out = []
    for key in ("step_time_ms", "tflops_per_gpu", "peak_mem_gb"):
        a, b = old.get(key), new.get(key)
        if a != b:
            rel = f" ({(b - a) / a:+.1%})" if _number(a) and _number(b) and a else ""
            out.append(f"{key} {a} -> {b}{rel}")
    old_loss, new_loss = old.get("loss") if isinstance(old.get("loss"), dict) else {}, new.get("loss") or {}
    if both := [k for k in new_loss if k in old_loss]:
        it = both[-1]
        if old_loss[it] != new_loss[it]:
            out.append(f"loss at iteration {it} {old_loss[it]} -> {new_loss[it]}")
    old_share = old.get("exposed_share") if isinstance(old.get("exposed_share"), dict) else {}
    for cls in sorted(set(old_share) | set(new.get("exposed_share") or {})):
        if old_share.get(cls) != (new.get("exposed_share") or {}).get(cls):
            out.append(f"exposed {cls} {old_share.get(cls)} -> {(new.get('exposed_share') or {}).get(cls)}")
    old_layout = old.get("layout") if isinstance(old.get("layout"), dict) else {}
    if moved := [k for k in sorted(set(old_layout) | set(new["layout"])) if old_layout.get(k) != new["layout"].get(k)]:
        out.append("layout " + ", ".join(f"{k} {old_layout.get(k)} -> {new['layout'].get(k)}" for k in moved))
    return out


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
