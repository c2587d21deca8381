"""The overlap report drawn for a person: a table per class and rank in the terminal (rich), and the timeline PNG of
one step of one rank (matplotlib, Agg: report jobs run on headless nodes)."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from overlapkit.regress.overlap_classes import CLASSES

COLORS = {
    "compute": "#9e9e9e",
    "tp": "tab:blue",
    "cp": "tab:purple",
    "pp": "tab:green",
    "dp": "tab:orange",
    "ep": "tab:cyan",
    "unclassified": "black",
}
COLUMNS = ("rank", "class", "kernels", "comm ms", "hidden ms", "exposed ms", "exposed")


def table(report: dict) -> Table:
    t = Table(title="Communication per overlap class and rank", title_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("rank", "class") else "right")
    rows = [("all", report["classes"])] + [(r, e["classes"]) for r, e in report["ranks"].items()]
    for rank, classes in rows:
        for cls in (*CLASSES, "unclassified"):
            c = classes.get(cls) if cls != "unclassified" or rank != "all" else report.get("unclassified")
            if not c or not c["kernels"]:
                continue
            t.add_row(
                rank,
                cls,
                str(c["kernels"]),
                f"{c['comm_ms']:.3f}",
                f"{c['hidden_ms']:.3f}",
                f"{c['exposed_ms']:.3f}",
                f"{c['exposed_share']:.1%}",
            )
    return t


def render(report: dict, con) -> None:
    lay = report["layout"]
    sizes = " ".join(f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if lay.get(k))
    con.print(f"[bold]{escape(str(report['recipe']))}[/]  {sizes} · {lay['gpus']} GPUs")
    con.print(f"measured {escape(report['window']['measured'])}")
    con.print(table(report))
    for r in report["rules"]:
        con.print(escape(f"rule [{r['class']}] {r['kernels']} × {r['rule']}"), soft_wrap=True)
    if png := report.get("timeline"):
        con.print(f"timeline: {escape(png)}", soft_wrap=True)
    for f in report["findings"]:
        style = "red" if f["level"] == "error" else "yellow"
        fix = f" (fix: {f['fix']})" if f["fix"] else ""
        con.print(f"[{style}]{f['level']}[/] {escape(f'[{f["code"]}] {f["message"]}{fix}')}", soft_wrap=True)
    errors = [f for f in report["findings"] if f["level"] == "error"]
    con.print("[green]claims: OK[/]" if not errors else f"[red]claims: {len(errors)} error(s)[/]")


def worst_step(trace, exposure) -> int:
    """The profiled step of `trace` with the most exposed communication (the first of equals): the one to look at."""
    exposed = [sum(exposure(trace, c, span)[1] for c in trace.comm) for span in trace.steps]
    return exposed.index(max(exposed))


def draw(trace, out: Path, exposure) -> Path:
    """The step of `trace` (an overlap_report.DeviceTrace) with the most exposed communication: one lane per stream
    active in it, each activity in its class's colour, and a last lane with each class's exposed communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = worst_step(trace, exposure)
    lo, hi = trace.steps[step]
    streams = sorted(st for st, acts in trace.streams.items() if any(e > lo and s < hi for s, e, _ in acts))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * (len(streams) + len(trace.comm))), dpi=90)
    to_ms = 1e-6
    for y, stream in enumerate(streams):
        for s, e, cls in trace.streams[stream]:
            if e > lo and s < hi:
                s, e = max(s, lo), min(e, hi)
                ax.broken_barh([((s - lo) * to_ms, (e - s) * to_ms)], (y - 0.4, 0.8), color=COLORS[cls])
    lanes = [f"stream {st}" for st in streams]
    for cls in trace.comm:  # one lane per class: the exposed part of its communication, hatched
        spans = exposure(trace, cls, (lo, hi))[2]
        if spans:
            bars = [((s - lo) * to_ms, (e - s) * to_ms) for s, e in spans]
            y = len(lanes)
            ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS[cls], hatch="//", edgecolor="red")
            lanes.append(f"{cls} exposed")
    ax.set_yticks(range(len(lanes)), lanes)
    where = f"step {step} of {len(trace.steps)}, the most exposed" if trace.step_source == "nvtx" else "the window"
    ax.set_xlabel(f"ms from the start of {where} ({trace.step_source})")
    ax.set_title(f"rank {trace.rank}: compute and communication per stream, exposed communication hatched")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in ("compute", *trace.comm)]
    ax.legend(handles, ["compute", *trace.comm], loc="upper right", fontsize=7, ncol=len(handles))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
