"""Proof of overlap: from a run's own profile (Nsight Systems' SQLite export, or the PyTorch profiler's trace), how
much of each class of communication (tp, cp, pp, dp, ep) the overlaps hid under compute, and the plan's claims
checked against it (docs/overlap_report.md).

Exposed time is exact interval arithmetic, per device: the union of a class's communication intervals minus the
union of every compute interval on the same device (any stream). It is measured per profiled step where the trace
tells steps apart (Bridge's train_step NVTX range, the PyTorch profiler's ProfilerStep#N), otherwise over the
profiled window, and the report says which.

`report_profiles(paths, plan)` returns the report as JSON-ready data, `timeline_png` draws one step of one rank,
`write` does both and leaves them in a run directory (`run_inputs`). Bad input raises ProfileError (one line).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from overlapkit import jsonio
from overlapkit.profile import overlap_claims
from overlapkit.profile import overlap_classes as oc
from overlapkit.profile.nsys_sqlite import Profile, ProfileError, load, profile_files, rank_of
from overlapkit.profile.torch_trace import STEP_PREFIX
from overlapkit.spec.planfile import read_plan
from overlapkit.spec.runopts import NSYS_DIR, OVERLAP_JSON, TORCH_DIR, planned_window


def union(intervals) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-touching intervals covering exactly the given half-open [start, end) ns ones."""
    out: list[tuple[int, int]] = []
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_e is not None and s <= cur_e:
            if e > cur_e:
                cur_e = e
        else:
            if cur_e is not None:
                out.append((cur_s, cur_e))
            cur_s, cur_e = s, e
    if cur_e is not None:
        out.append((cur_s, cur_e))
    return out


def subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of union `a` outside union `b` (both as `union` returns them): one merge pass."""
    out, j, n = [], 0, len(b)
    for s, e in a:
        cur = s
        while j < n and b[j][1] <= cur:
            j += 1
        k = j
        while k < n and (bs := b[k])[0] < e:
            if bs[0] > cur:
                out.append((cur, bs[0]))
            if bs[1] > cur:
                cur = bs[1]
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def per_span(intervals: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """The length of sorted disjoint `intervals` inside each of sorted disjoint `spans`: one merge pass."""
    out, j, m = [], 0, len(intervals)
    for lo, hi in spans:
        while j < m and intervals[j][1] <= lo:
            j += 1
        k, n = j, 0
        while k < m and (s := intervals[k][0]) < hi:
            e = intervals[k][1]
            n += (e if e < hi else hi) - (s if s > lo else lo)
            k += 1
        out.append(n)
    return out


# With profiling.nvtx_ranges, each iteration is Bridge's train_step range (training/train.py, 0.6.2: @nvtx_decorator,
# <module>.<function>); in a PyTorch trace, torch.profiler's ProfilerStep#<N>, which Bridge steps once per iteration.
STEP_RANGE = "train_step"
STEP_SOURCES = {"nvtx": "Bridge's train_step NVTX ranges", "profiler_step": "the PyTorch profiler's ProfilerStep#N"}


def steps_of(prof: Profile, device: int) -> tuple[str, list[tuple[int, int]]]:
    """(source, one GPU span per step) when the trace has step ranges (source "nvtx" or "profiler_step"), else
    ("window", [the whole profile]). One pass over the device's activities, each placed by bisection."""
    acts = [a for a in (*prof.kernels, *prof.memcpys) if a.device == device]
    if ranges := [r for r in prof.ranges if r.text.endswith(STEP_RANGE)]:
        source = "nvtx"
    else:
        source, ranges = "profiler_step", [r for r in prof.ranges if r.text.startswith(STEP_PREFIX)]
    by_tid = defaultdict(list)
    for r in sorted(ranges, key=lambda r: r.start):
        by_tid[r.tid].append(r)
    starts = {tid: [r.start for r in rs] for tid, rs in by_tid.items()}
    ends = {tid: [r.end for r in rs] for tid, rs in by_tid.items()}
    # per thread and range: the first start and the last end of what was launched in it (the rightmost of equal
    # starts is the one a launch falls in, so the range's index stands for the range)
    first = {tid: [None] * len(rs) for tid, rs in by_tid.items()}
    last = {tid: [None] * len(rs) for tid, rs in by_tid.items()}
    launches, right, cur = prof.launches, bisect.bisect_right, object()
    for a in acts:
        # A CPU range projected onto the GPU: from the first to the last activity launched inside it.
        if (la := launches.get(a[5])) is None:  # a.correlation (by position: one lookup less per activity)
            continue
        t, tid = la[0], la[1]
        if tid != cur:  # one thread launches nearly everything: its lists looked up once per run of it
            cur, ts, te, fs, ls = tid, starts.get(tid), ends.get(tid), first.get(tid), last.get(tid)
        if ts is None or (i := right(ts, t) - 1) < 0 or te[i] < t:
            continue
        if (f := fs[i]) is None or a[0] < f:
            fs[i] = a[0]
        if (e := ls[i]) is None or a[1] > e:
            ls[i] = a[1]
    spans = sorted((f, e) for tid in first for f, e in zip(first[tid], last[tid], strict=True) if f is not None)
    if spans:
        # A step's tail (its last grad reduce-scatter) may still run when the next step's first kernels start: the
        # overlap goes to the later step, so that no interval is counted twice.
        tails = [min(e, nxt[0]) for (_, e), nxt in zip(spans, spans[1:], strict=False)] + [spans[-1][1]]
        return source, [(s, max(s, e)) for (s, _), e in zip(spans, tails, strict=True)]
    return "window", [(min(a.start for a in acts), max(a.end for a in acts))]


@dataclass
class DeviceTrace:
    """One profiled rank's device, measured: per step, each class's communication and exposed ns. The profile
    itself is not kept (ranks are read one at a time)."""

    rank: str
    file: str
    device: int
    gpu: str | None
    kernels: Counter  # class → activity count
    step_source: str
    steps: list[tuple[int, int]]
    figures: list[dict[str, tuple[int, int]]]  # per step: {class: (communication ns, exposed ns)}


@dataclass
class Timeline:
    """What the PNG draws of one step of one rank, bounded whatever the profile's size: per stream (the busiest
    MAX_LANES, the rest in one lane) and class, the merged intervals, gaps under a pixel closed; each class's exposed
    intervals the same way."""

    rank: str
    step: int
    steps: int
    source: str
    span: tuple[int, int]
    lanes: list[tuple[str, dict[str, list[tuple[int, int]]]]]
    exposed: dict[str, list[tuple[int, int]]]


@dataclass
class Measured:
    plan: dict
    traces: list[DeviceTrace]
    rules: Counter  # (class, rule) → activities
    unclassified: Counter  # "pp or ep" → activities
    unknown: dict = field(default_factory=dict)  # communication-like kernel name no rule knows → [count, ns]
    timeline: Timeline | None = None  # of the first rank's first device


def _order(label: str) -> list:
    return [int(p) if p.isdigit() else p for p in label.replace("/gpu", "/").split("/")]


def measure(paths: list[Path], plan: dict) -> Measured:
    """Every profile in `paths` measured against the plan's layout, one file at a time: a rank's profile is read,
    classified (each distinct kernel name matched once), swept once per class, and dropped before the next is read,
    so memory is bounded by one rank's profile whatever the number of ranks."""
    lay = oc.Layout.of_plan(plan)
    m = Measured(plan, [], Counter(), Counter())
    files: dict[str, Path] = {}
    for i, path in enumerate(paths):
        prof = load(path)
        decisions = oc.classify(prof, lay)
        rank = prof.rank if prof.rank is not None else rank_of(prof.path)
        base = str(rank if rank is not None else i)
        devices = prof.devices
        for dev in devices:
            label = base if len(devices) == 1 else f"{base}/gpu{dev}"
            if label in files:
                raise ProfileError(
                    f"{files[label]} and {path} are both rank {label}: give the profiles of one run (move one away)"
                )
            files[label] = path
            drawn = m.timeline is None or _order(label) < _order(m.timeline.rank)
            trace, streams, exposed = _device_trace(label, prof, dev, decisions, m, lanes=drawn)
            m.traces.append(trace)
            if drawn:
                m.timeline = _timeline(trace, streams, exposed)
        del prof, decisions
    m.traces.sort(key=lambda t: _order(t.rank))
    return m


def _device_trace(label, prof, dev, decisions, m: Measured, lanes: bool = True) -> tuple[DeviceTrace, dict, dict]:
    """The device's trace measured, its raw intervals per stream and class (`lanes`: for the timeline) and its exposed
    ones per class. The one pass over every activity of the profile that the figures need: a few operations each."""
    compute, comm, kernels = [], defaultdict(list), Counter()
    streams: dict = defaultdict(lambda: defaultdict(list))
    comm_like: dict[str, bool] = {}  # each distinct name searched once: a profile repeats each thousands of times
    decided, like_comm, add = decisions.get, comm_like.get, compute.append
    for a in (*prof.kernels, *prof.memcpys):
        if a[2] != dev:  # a.device; the fields by position in this loop: an attribute costs a lookup per activity
            continue
        d = decided(id(a))
        if d is None:
            if a[6] is None:  # a.copy_kind: host/device copies other than peer-to-peer are neither
                add(iv := a[:2])
                if lanes:
                    streams[a[3]]["compute"].append(iv)
                if (like := like_comm(name := a[4])) is None:
                    like = comm_like[name] = oc.COMM_LIKE.search(name) is not None
                if like:  # no rule knows it (it has no decision), yet its name looks like communication
                    seen = m.unknown.setdefault(name, [0, 0])
                    seen[0], seen[1] = seen[0] + 1, seen[1] + a[1] - a[0]
            continue
        cls = d.cls or "unclassified"
        comm[cls].append(iv := a[:2])
        kernels[cls] += 1
        if lanes:
            streams[a[3]][cls].append(iv)
        if d.cls is None:
            m.unclassified[" or ".join(d.candidates)] += 1
        else:
            m.rules[(d.cls, d.rule)] += 1
    source, steps = steps_of(prof, dev)
    busy = union(compute)
    figures: list[dict] = [{} for _ in steps]
    for cls in (c for c in (*oc.CLASSES, "unclassified") if c in comm):
        u = union(comm[cls])
        exposed = subtract(u, busy)
        for fig, c, e in zip(figures, per_span(u, steps), per_span(exposed, steps), strict=True):
            fig[cls] = (c, e)
        comm[cls] = exposed  # what the timeline marks
    gpu = prof.gpus[0] if prof.gpus else None
    return DeviceTrace(label, prof.path.name, dev, gpu, kernels, source, steps, figures), streams, comm


MAX_LANES = 24  # streams drawn one lane each; the rest share one
PIXELS = 2000  # the figure is 990 px wide (11 in at 90 dpi): a gap under 1/2000 of the step cannot be seen


def _timeline(trace: DeviceTrace, streams: dict, exposed: dict) -> Timeline:
    """What to draw of `trace`: its profiled step with the most exposed communication (the first of equals)."""
    worst = [sum(e for _, e in fig.values()) for fig in trace.figures]
    step = worst.index(max(worst))
    lo, hi = trace.steps[step]
    gap = max(1, (hi - lo) // PIXELS)

    def drawn(intervals):
        # the step's part of the union is the union of the step's parts: only the intervals that reach into it
        inside = union([iv for iv in intervals if iv[1] > lo and iv[0] < hi])
        return coarse([(max(s, lo), min(e, hi)) for s, e in inside], gap)

    per_stream = {st: {c: drawn(ivs) for c, ivs in by_cls.items()} for st, by_cls in streams.items()}
    per_stream = {st: {c: ivs for c, ivs in d.items() if ivs} for st, d in per_stream.items()}
    load = {st: sum(length(v) for v in d.values()) for st, d in per_stream.items() if d}
    busy = sorted(load, key=lambda st: -load[st])
    lanes = [(f"stream {st}", per_stream[st]) for st in sorted(busy[:MAX_LANES])]
    if rest := busy[MAX_LANES:]:
        merged = defaultdict(list)
        for st in rest:
            for c, ivs in per_stream[st].items():
                merged[c] += ivs
        lanes.append((f"{len(rest)} other streams", {c: coarse(union(v), gap) for c, v in merged.items()}))
    exposed = {c: drawn(ivs) for c, ivs in exposed.items()}
    return Timeline(trace.rank, step, len(trace.steps), trace.step_source, (lo, hi), lanes, exposed)


def coarse(intervals: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted disjoint intervals with every gap shorter than `gap` closed: at most (span / gap) + 1 of them."""
    out: list[list[int]] = []
    for s, e in intervals:
        if out and s - out[-1][1] < gap:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)  # a microsecond is the finest figure the report gives


def _entry(comm: int, exposed: int, kernels: int | None = None) -> dict:
    share = round(exposed / comm, 4) if comm else 0.0
    out = {"comm_ms": _ms(comm), "hidden_ms": _ms(comm - exposed), "exposed_ms": _ms(exposed), "exposed_share": share}
    return out if kernels is None else out | {"kernels": kernels}  # a step's kernels are counted in the window's


def report_of(m: Measured) -> dict:
    ranks = {}
    for t in m.traces:
        names = [c for c in (*oc.CLASSES, "unclassified") if c in t.kernels]
        per_step = []
        for i, (span, fig) in enumerate(zip(t.steps, t.figures, strict=True)):
            per_step.append({"step": i, "span_ms": _ms(span[1] - span[0])} | {c: _entry(*fig[c]) for c in names})
        figs = t.figures
        ranks[t.rank] = {
            "file": t.file,
            "device": t.device,
            "gpu": t.gpu,
            "steps": {"source": t.step_source, "count": len(t.steps)},
            "classes": {c: _entry(sum(f[c][0] for f in figs), sum(f[c][1] for f in figs), t.kernels[c]) for c in names},
            "per_step": per_step,
        }
    classes = {}
    for c in (*oc.CLASSES, "unclassified"):
        pairs = [f[c] for t in m.traces for f in t.figures if c in f]
        if pairs or c in oc.CLASSES:
            n = sum(t.kernels[c] for t in m.traces)
            classes[c] = _entry(sum(p[0] for p in pairs), sum(p[1] for p in pairs), n)
    unclassified = classes.pop("unclassified", None)
    if unclassified is not None:
        unclassified["candidates"] = dict(m.unclassified)
    sources = sorted({t.step_source for t in m.traces})
    if "window" in sources:
        how = "per profiled window (no train_step NVTX or ProfilerStep ranges in the trace: steps not told apart)"
    else:
        how = "per step: " + " and ".join(STEP_SOURCES[s] for s in sources) + " ranges"
    planned = (planned_window(m.plan.get("run")) or (None, {}))[1]
    report = {
        "recipe": m.plan.get("recipe"),
        "layout": {k: m.plan["layout"].get(k) for k in ("tp", "pp", "cp", "dp", "ep", "vpp", "gpus", "nodes")},
        "classes": classes,
        "unclassified": unclassified,
        "ranks": ranks,
        "window": {
            "measured": how,
            "step_sources": sources,
            "planned_steps": planned.get("steps"),
            "ranks": planned.get("ranks"),
        },
        "rules": [{"class": c, "rule": r, "kernels": n} for (c, r), n in sorted(m.rules.items())],
        "unknown_comm": [
            {"name": name, "kernels": n, "ms": _ms(t)}
            for name, (n, t) in sorted(m.unknown.items(), key=lambda x: -x[1][1])
        ],
    }
    report["findings"] = overlap_claims.findings(report, m.plan)
    return report


def report_profiles(paths: list[Path], plan: dict) -> dict:
    """The report of the given per-rank profiles (Nsight exports or PyTorch traces) against `plan` (a plan's to_dict,
    as plan.json holds it)."""
    files = [f for p in paths for f in profile_files(Path(p), skip=(OVERLAP_JSON,))]
    return report_of(measure(files, plan))


def run_inputs(run_dir: Path) -> tuple[list[Path], dict]:
    """A run directory's profiles (<run dir>/nsys/ and <run dir>/torch_profile/) and its plan (plan.json, through the
    one reader of it), or one line saying what is missing or broken."""
    run_dir = Path(run_dir)
    plan = read_plan(run_dir)
    if not (dirs := [run_dir / d for d in (NSYS_DIR, TORCH_DIR) if (run_dir / d).is_dir()]):
        hint = "has the job run?" if planned_window(plan.get("run")) else PROFILE_HINT
        raise ProfileError(f"RUN={run_dir}: no {NSYS_DIR}/ or {TORCH_DIR}/ directory of profiles ({hint})")
    return [f for d in dirs for f in profile_files(d)], plan


PROFILE_HINT = "launch with NSYS=<start>:<end>, or TORCH_PROFILE=<start>:<end> for the PyTorch profiler"


def timeline_png(m: Measured, out_path: Path) -> Path:
    """One PNG: one step of the first rank (its most exposed profiled step), compute and each class on their streams,
    exposed communication marked; written atomically, never through a link at `out_path`."""
    from overlapkit.profile import overlap_render

    if m.timeline is None:
        raise ProfileError("no profile to draw")
    return overlap_render.draw(m.timeline, Path(out_path))


def write(files: list[Path], plan: dict, png: Path, run_dir: Path | None = None) -> tuple[dict, str | None]:
    """The report of `files` against `plan` with its timeline drawn at `png` (its path in report["timeline"]), and for
    a run directory, written as its OVERLAP_JSON; and None, or why the picture could not be written (a read-only
    directory: the figures stand without it)."""
    m = measure(files, plan)
    report, warning = report_of(m), None
    try:
        report["timeline"] = str(timeline_png(m, png))
    except OSError as exc:
        report["timeline"] = None
        warning = f"the timeline was not written to {png} ({exc.strerror or exc})"
    if run_dir is not None:
        jsonio.write_json(Path(run_dir) / OVERLAP_JSON, report)
    return report, warning
