"""Proof of overlap: from a run's own Nsight Systems profile, how much of each class of communication (tp, cp, pp,
dp, ep) the overlaps hid under compute, and the plan's claims checked against it (docs/overlap_report.md).

Exposed time is exact interval arithmetic, per device: the union of a class's communication intervals minus the
union of every compute interval on the same device (any stream). It is measured per profiled step where the trace
tells steps apart (Bridge's train_step NVTX range), otherwise over the profiled window, and the report says which.

`report_run(run_dir)` and `report_profiles(paths, plan)` return the report as JSON-ready data; `timeline_png` draws one
step of one rank; `write_run` leaves both in a run directory (plan/runopts.py: OVERLAP_JSON, OVERLAP_PNG). Bad input
raises ProfileError (one line).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio
from overlapkit.plan.runopts import NSYS_DIR, OVERLAP_JSON, OVERLAP_PNG
from overlapkit.regress import overlap_claims
from overlapkit.regress import overlap_classes as oc
from overlapkit.regress.nsys_sqlite import Profile, ProfileError, profile_files, rank_of, read

__all__ = ["ProfileError", "report_run", "report_profiles", "timeline_png", "write_run", "measure", "union", "subtract"]

# --- interval arithmetic on half-open [start, end) nanosecond intervals --------------------------------------------


def union(intervals) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-touching intervals covering exactly the given ones."""
    out: list[list[int]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of union `a` outside union `b` (both as `union` returns them): one merge pass."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def clip(intervals, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


# --- steps ----------------------------------------------------------------------------------------------------------

# Bridge wraps every training iteration in an NVTX range when profiling.nvtx_ranges is on: train_step carries
# @nvtx_decorator() (megatron/bridge/training/train.py, Bridge 0.6.2), named <module>.<function> by Megatron's
# nvtx_decorator (megatron/core/utils.py, core 0.19).
STEP_RANGE = "train_step"


def steps_of(prof: Profile, device: int) -> tuple[str, list[tuple[int, int]]]:
    """("nvtx", one GPU span per step) when the trace has step ranges, else ("window", [the whole profile])."""
    acts = [a for a in prof.kernels + prof.memcpys if a.device == device]
    ranges = sorted((r for r in prof.ranges if r.text.endswith(STEP_RANGE)), key=lambda r: r.start)
    spans = []
    for r in ranges:
        # A CPU range projected onto the GPU: from the first to the last activity launched inside it.
        inside = [a for a in acts if (la := prof.launches.get(a.correlation)) and la[1] == r.tid]
        inside = [a for a in inside if r.start <= prof.launches[a.correlation][0] <= r.end]
        if inside:
            spans.append((min(a.start for a in inside), max(a.end for a in inside)))
    if spans:
        # A step's tail (its last grad reduce-scatter) may still run when the next step's first kernels start: the
        # overlap goes to the later step, so that no interval is counted twice.
        ends = [min(e, nxt[0]) for (_, e), nxt in zip(spans, spans[1:], strict=False)] + [spans[-1][1]]
        return "nvtx", [(s, max(s, e)) for (s, _), e in zip(spans, ends, strict=True)]
    return "window", [(min(a.start for a in acts), max(a.end for a in acts))]


# --- measurement ----------------------------------------------------------------------------------------------------


@dataclass
class DeviceTrace:
    """One profiled rank's device: its activities sorted into compute and per-class communication."""

    rank: str
    prof: Profile
    device: int
    compute: list[tuple[int, int]]  # union
    comm: dict[str, list[tuple[int, int]]]  # class (or "unclassified") → raw intervals
    kernels: Counter  # class → activity count
    step_source: str
    steps: list[tuple[int, int]]
    streams: dict = field(default_factory=dict)  # stream → [(start, end, class or "compute")]


@dataclass
class Measured:
    plan: dict
    traces: list[DeviceTrace]
    rules: Counter  # (class, rule) → activities
    unclassified: Counter  # "pp or ep" → activities


def measure(paths: list[Path], plan: dict) -> Measured:
    lay = oc.Layout.of_plan(plan)
    traces, rules, unclassified = [], Counter(), Counter()
    profs = [read(p) for p in paths]
    for i, prof in enumerate(profs):
        decisions = oc.classify(prof, lay)
        file_rank = rank_of(prof.path)
        base = str(file_rank if file_rank is not None else i)
        for dev in prof.devices:
            label = base if len(prof.devices) == 1 else f"{base}/gpu{dev}"
            traces.append(_device_trace(label, prof, dev, decisions, rules, unclassified))
    traces.sort(key=lambda t: [int(p) if p.isdigit() else p for p in t.rank.replace("/gpu", "/").split("/")])
    return Measured(plan, traces, rules, unclassified)


def _device_trace(label, prof, dev, decisions, rules, unclassified) -> DeviceTrace:
    compute, comm, kernels, streams = [], defaultdict(list), Counter(), defaultdict(list)
    for a in prof.kernels + prof.memcpys:
        if a.device != dev:
            continue
        d = decisions.get(id(a))
        if d is None:
            if oc.is_compute(a):
                compute.append((a.start, a.end))
                streams[a.stream].append((a.start, a.end, "compute"))
            continue  # host/device copies other than peer-to-peer: neither
        cls = d.cls or "unclassified"
        comm[cls].append((a.start, a.end))
        kernels[cls] += 1
        streams[a.stream].append((a.start, a.end, cls))
        if d.cls is None:
            unclassified[" or ".join(d.candidates)] += 1
        else:
            rules[(d.cls, d.rule)] += 1
    source, steps = steps_of(prof, dev)
    return DeviceTrace(label, prof, dev, union(compute), dict(comm), kernels, source, steps, dict(streams))


def exposure(trace: DeviceTrace, cls: str, span: tuple[int, int]) -> tuple[int, int, list[tuple[int, int]]]:
    """(communication ns, exposed ns, exposed intervals) of class `cls` on `trace` within `span`."""
    lo, hi = span
    comm = clip(union(trace.comm.get(cls, [])), lo, hi)
    exposed = subtract(comm, clip(trace.compute, lo, hi))
    return length(comm), length(exposed), exposed


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)  # a microsecond is the finest figure the report gives


def _entry(comm: int, exposed: int, kernels: int) -> dict:
    return {
        "comm_ms": _ms(comm),
        "hidden_ms": _ms(comm - exposed),
        "exposed_ms": _ms(exposed),
        "exposed_share": round(exposed / comm, 4) if comm else 0.0,
        "kernels": kernels,
    }


def _figures(t: DeviceTrace) -> list[dict[str, tuple[int, int]]]:
    """Per step: {class: (communication ns, exposed ns)} for the classes this device ran."""
    names = [c for c in (*oc.CLASSES, "unclassified") if c in t.comm]
    return [{c: exposure(t, c, span)[:2] for c in names} for span in t.steps]


def _rank_entry(t: DeviceTrace, figures: list[dict]) -> dict:
    names = list(figures[0]) if figures else []
    per_step = []
    for i, (span, fig) in enumerate(zip(t.steps, figures, strict=True)):
        row = {c: _entry(*fig[c], t.kernels[c]) for c in names}
        for c in names:
            del row[c]["kernels"]  # counted once, for the whole window
        per_step.append({"step": i, "span_ms": _ms(span[1] - span[0])} | row)
    classes = {c: _entry(sum(f[c][0] for f in figures), sum(f[c][1] for f in figures), t.kernels[c]) for c in names}
    return {
        "file": t.prof.path.name,
        "device": t.device,
        "gpu": t.prof.gpus[0] if t.prof.gpus else None,
        "steps": {"source": t.step_source, "count": len(t.steps)},
        "classes": classes,
        "per_step": per_step,
    }


def report_of(m: Measured) -> dict:
    figs = {t.rank: _figures(t) for t in m.traces}
    ranks = {t.rank: _rank_entry(t, figs[t.rank]) for t in m.traces}
    classes = {}
    for c in (*oc.CLASSES, "unclassified"):
        pairs = [f[c] for per_step in figs.values() for f in per_step if c in f]
        if pairs or c in oc.CLASSES:
            n = sum(t.kernels[c] for t in m.traces)
            classes[c] = _entry(sum(p[0] for p in pairs), sum(p[1] for p in pairs), n)
    unclassified = classes.pop("unclassified", None)
    if unclassified is not None:
        unclassified["candidates"] = dict(m.unclassified)
    sources = sorted({t.step_source for t in m.traces})
    report = {
        "recipe": m.plan.get("recipe"),
        "layout": {k: m.plan["layout"].get(k) for k in ("tp", "pp", "cp", "dp", "ep", "vpp", "gpus", "nodes")},
        "classes": classes,
        "unclassified": unclassified,
        "ranks": ranks,
        "window": _window(m, sources),
        "rules": [{"class": c, "rule": r, "kernels": n} for (c, r), n in sorted(m.rules.items())],
    }
    report["findings"] = overlap_claims.findings(report, m.plan)
    return report


def _window(m: Measured, sources: list[str]) -> dict:
    nsys = (m.plan.get("run") or {}).get("nsys") or {}
    how = (
        "per step: Bridge's train_step NVTX ranges"
        if sources == ["nvtx"]
        else "per profiled window (no train_step NVTX ranges in the trace: steps not told apart)"
    )
    return {"measured": how, "step_sources": sources, "planned_steps": nsys.get("steps"), "ranks": nsys.get("ranks")}


def report_profiles(paths: list[Path], plan: dict) -> dict:
    """The report of the given per-rank exports against `plan` (a plan's to_dict, as plan.json holds it)."""
    files = [f for p in paths for f in profile_files(Path(p))]
    return report_of(measure(files, plan))


def run_inputs(run_dir: Path) -> tuple[list[Path], dict]:
    """A run directory's profiles (<run dir>/nsys/) and its plan (plan.json), or one line saying what is missing."""
    run_dir = Path(run_dir)
    plan = jsonio.read_json(run_dir / "plan.json")
    if plan is None or "layout" not in plan:
        raise ProfileError(f"RUN={run_dir}: no plan.json there (make plan writes runs/<recipe>-<time>/plan.json)")
    nsys = run_dir / NSYS_DIR
    if not nsys.is_dir():
        hint = "launch with NSYS=<start>:<end>" if not (plan.get("run") or {}).get("nsys") else "has the job run?"
        raise ProfileError(f"RUN={run_dir}: no nsys/ directory of profiles ({hint})")
    return profile_files(nsys), plan


def report_run(run_dir: Path) -> dict:
    """The report of a run directory as `make plan` / `make submit` wrote it, with the profiles in its nsys/."""
    return report_of(measure(*run_inputs(run_dir)))


def timeline_png(m: Measured, out_path: Path, rank: str | None = None) -> Path:
    """One PNG: one step of one rank (the middle profiled step of the first rank by default), compute and each
    class on their streams, exposed communication marked."""
    from overlapkit.regress import overlap_render

    trace = next((t for t in m.traces if rank is None or t.rank == rank), None)
    if trace is None:
        raise ProfileError(f"rank {rank} is not in the profiles (ranks: {', '.join(t.rank for t in m.traces)})")
    return overlap_render.draw(trace, Path(out_path), exposure)


def save(m: Measured, report: dict, png: Path, run_dir: Path | None = None) -> str | None:
    """The timeline drawn at `png` with its path in report["timeline"], then, for a run directory, the report as its
    OVERLAP_JSON. None, or why the picture could not be written (a read-only directory: the figures stand without
    it)."""
    warning = None
    try:
        report["timeline"] = str(timeline_png(m, png))
    except OSError as exc:
        report["timeline"] = None
        warning = f"the timeline was not written to {png} ({exc.strerror or exc})"
    if run_dir is not None:
        jsonio.write_json(Path(run_dir) / OVERLAP_JSON, report)
    return warning


def write_run(run_dir: Path) -> str | None:
    """A run directory's report and timeline written into it (OVERLAP_JSON, OVERLAP_PNG), as `make overlap-report RUN=`
    leaves them; save's warning. Raises ProfileError as report_run."""
    m = measure(*run_inputs(Path(run_dir)))
    return save(m, report_of(m), Path(run_dir) / OVERLAP_PNG, Path(run_dir))
