"""The overlap report drawn for a person: a table per class and rank in the terminal (rich), and the timeline PNG of
one step of one rank (matplotlib, Agg: report jobs run on headless nodes)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from overlapkit import jsonio
from overlapkit.errors import BadInput, one_line
from overlapkit.profile.overlap_classes import CLASSES

# The PNG's Software text (a tEXt chunk, PNG spec 11.3.4.2 "Software"): what marks a file as this command's own
# output, which it may replace; any other file at PNG= is the user's, replaced only with FORCE=1.
TAG = "overlapkit make overlap-report"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OWN_LIMIT = 8 * jsonio.MiB  # a timeline is ~100 KB; a larger file is not one


def console(file=None, width: int | None = None) -> Console:
    """The terminal every command prints its tables to (the plan's, the recipes' and this report's)."""
    con = Console(file=file, width=width, highlight=False, soft_wrap=False)
    if width is None and not con.is_terminal:
        con.width = 150  # piped or in CI: wide enough for the overlap and recipe tables without wrapping every row
    return con


def safe(value) -> str:
    """Text from a trace or a plan as the terminal may show it: control characters and escape sequences shown
    escaped (errors.one_line), rich markup escaped: a kernel name cannot clear the screen or colour the output."""
    return escape(one_line(str(value)))


def is_timeline(path: Path) -> bool:
    """Whether `path` is a regular file this command wrote (a PNG carrying TAG), read through the guarded reader."""
    try:
        data = jsonio.read_bytes(path, OWN_LIMIT, follow=False)
    except (FileNotFoundError, jsonio.Unreadable):
        return False
    return data.startswith(PNG_MAGIC) and b"tEXtSoftware\x00" + TAG.encode() in data


def png_target(text: str, *, force: bool = False, own: bool = False) -> Path:
    """Where the timeline goes, checked before anything is measured: a name ending in .png (a name before the
    suffix: `.png` is a hidden file without one), not a directory, and where a file is already there, one this
    command wrote (`own`: the run directory's own name), else FORCE=1. BadInput, one line naming the fix."""
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise BadInput(f"PNG={text}: the timeline is a PNG; give a file name ending in .png (e.g. timeline.png)")
    if path.is_dir():
        raise BadInput(f"PNG={text} is a directory: give a file name in it ending in .png")
    if not own and not force and os.path.lexists(path) and not is_timeline(path):
        raise BadInput(
            f"PNG={text} exists and is not a timeline make overlap-report wrote: give another PNG=, or FORCE=1 to "
            "replace it"
        )
    return path


COLORS = {"compute": "#9e9e9e", "tp": "tab:blue", "cp": "tab:purple", "pp": "tab:green", "dp": "tab:orange"}
COLORS |= {"ep": "tab:cyan", "unclassified": "black"}
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
            ms = (f"{c[k]:.3f}" for k in ("comm_ms", "hidden_ms", "exposed_ms"))
            t.add_row(safe(rank), cls, str(c["kernels"]), *ms, f"{c['exposed_share']:.1%}")
    return t


def render(report: dict, con) -> None:
    lay = report["layout"]
    sizes = " ".join(f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if lay.get(k))
    con.print(f"[bold]{safe(report['recipe'])}[/]  {safe(sizes)} · {safe(lay['gpus'])} GPUs")
    con.print(f"measured {safe(report['window']['measured'])}")
    con.print(table(report))
    for r in report["rules"]:
        con.print(safe(f"rule [{r['class']}] {r['kernels']} × {r['rule']}"), soft_wrap=True)
    if png := report.get("timeline"):
        con.print(f"timeline: {safe(png)}", soft_wrap=True)
    for f in report["findings"]:
        style = "red" if f["level"] == "error" else "yellow"
        fix = f" (fix: {f['fix']})" if f["fix"] else ""
        con.print(f"[{style}]{f['level']}[/] {safe(f'[{f["code"]}] {f["message"]}{fix}')}", soft_wrap=True)
    errors = [f for f in report["findings"] if f["level"] == "error"]
    con.print("[green]claims: OK[/]" if not errors else f"[red]claims: {len(errors)} error(s)[/]")


def draw(t, out: Path) -> Path:
    """The timeline `t` (an overlap_report.Timeline: one step, bounded bars) as a PNG at `out`: one lane per stream,
    each class in its colour, and a last lane per class with its exposed communication. Written atomically (a temp
    file of its own in the directory, then renamed): a link planted at `out` is replaced, never written through."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out.suffix.lower() != ".png":  # png_target checked it before anything was measured: this is a bug
        raise ValueError(f"{out}: the timeline is a PNG, its name must end in .png (png_target checks first)")
    lo, hi = t.span
    to_ms = 1e-6
    classes = [c for c in COLORS if c != "compute" and (t.exposed.get(c) or any(c in d for _, d in t.lanes))]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * (len(t.lanes) + len(classes))), dpi=90)
    names = []
    for y, (name, by_cls) in enumerate(t.lanes):
        for cls, spans in by_cls.items():
            bars = [((s - lo) * to_ms, (e - s) * to_ms) for s, e in spans]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS[cls])
        names.append(name)
    for cls in classes:  # one lane per class: the exposed part of its communication, hatched
        if spans := t.exposed.get(cls):
            bars = [((s - lo) * to_ms, (e - s) * to_ms) for s, e in spans]
            ax.broken_barh(bars, (len(names) - 0.4, 0.8), color=COLORS[cls], hatch="//", edgecolor="red")
            names.append(f"{cls} exposed")
    ax.set_yticks(range(len(names)), names)
    where = f"step {t.step} of {t.steps}, the most exposed" if t.source != "window" else "the window"
    ax.set_xlabel(f"ms from the start of {where} ({t.source})")
    ax.set_title(f"rank {t.rank}: compute and communication per stream, exposed communication hatched")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in ("compute", *classes)]
    ax.legend(handles, ["compute", *classes], loc="upper right", fontsize=7, ncol=len(handles))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": TAG})
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    return jsonio.write_text(out, buf.getvalue())
