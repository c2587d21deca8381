"""Human-readable rendering (rich) of plans, audits, memory estimates, launch-environment ledgers and the recipe
list. Everything a person reads in a terminal is drawn here; the JSON forms live beside their data."""

from __future__ import annotations

import itertools

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from overlapkit.bridge import stack
from overlapkit.bridge.env import LAYERS
from overlapkit.bridge.runopts import lines as run_lines
from overlapkit.spec.overlap import Overlap

STYLE = {"on": "green", "off": "red", "n/a": "dim", "error": "red", "warning": "yellow"}  # row states, finding levels
LABELLED = set(Overlap)


def table(title: str, columns: tuple[str, ...], rows, right: tuple[str, ...] = ()) -> Table:
    """A plan's table: its title on the left, the `right` columns right-justified (numbers), one row per item."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left")
    for row in rows:
        t.add_row(*row)
    return t


def render_plan(plan, con: Console) -> None:
    d = plan.to_dict()
    con.print(f"[bold]{d['recipe']}[/]  {d['layout']['model']}")
    con.print(f"source: {escape(d['source'])}")
    for line in stack.version_drift():  # a drifted install: the plan stands, Bridge's resolution may differ
        con.print(f"[yellow]warning[/] {escape(line)}")
    lay, vpp = d["layout"], d["layout"]["vpp"] or "-"
    ep = active = ""
    if "ep" in lay:  # MoE: expert parallelism, expert-DP, and parameters active per token
        ep = f" EP{lay['ep']} ETP{lay['etp']} expert-DP{lay['expert_dp']}"
        active = f" ({lay['active_params_b']}B active per token without the embedding lookup, top-{lay['topk']} of "
        active += f"{lay['experts']} experts)"
    con.print(
        f"{lay['gpus']} GPUs = {lay['nodes']} nodes × 8 · TP{lay['tp']} PP{lay['pp']} CP{lay['cp']} "
        f"VP{vpp}{ep} DP{lay['dp']} · MBS {lay['mbs']} GBS {lay['gbs']} · seq {lay['seq']} · "
        f"{lay['dtype']} · {lay['params_b']}B params{active}"
    )
    if d["gpu_note"]:
        con.print(escape(d["gpu_note"]))
    for o in d["overrides"]:
        con.print(escape(f"override: {o['key']} = {o['new']} (was {o['old']})"))
    states = [(r.name, f"[{STYLE.get(r.state, '')}]{r.state}[/]", escape(r.detail)) for r in plan.report.rows]
    con.print(table("Overlap stack (resolved by Bridge for this target)", ("overlap", "state", "why"), states))
    est = plan.memory
    parts = [(name, f"{gb:.2f}", note) for name, gb, note in est.rows()]
    title = "Memory estimate per GPU (first pipeline stage, GB = GiB)"
    con.print(table(title, ("component", "GB", "how"), parts, right=("GB",)))
    con.print(escape(est.summary()))
    pred = plan.throughput  # sizing.throughput's breakdown: term, seconds per step, share of the step, how
    terms = [(name, f"{sec:.3f}", f"{sec / pred.step_s:.1%}", escape(how)) for name, sec, how in pred.terms]
    title = "Predicted step time (overlapkit.sizing.throughput)"
    con.print(table(title, ("term", "s/step", "share", "how"), terms, right=("s/step", "share")))
    con.print(escape(pred.summary()))
    if plan.worth:  # sizing.worth: per overlap that is on, the predicted step with that one overlap off
        cols = ("overlap (on)", f"s/step with it off (vs {pred.step_s:.3f})", "+s/step", "+%")
        worth = [
            (w.to_dict()["row"], f"{w.off_step_s:.3f}", f"{w.delta_s:+.3f}", f"{w.delta_pct:+.1f}%")
            for w in plan.worth.values()
        ]
        con.print(table("What each overlap is worth", cols, worth, right=cols[1:]))
    for k in d["throughput"]["not_modelled"]:  # sizing/knobs.py: what moves the step beyond the prediction
        con.print(escape(f"not modelled: {k['setting']}: {k['direction']} ({k['why']})"))
    for line in run_lines(d):  # data, checkpoints, segments, Nsight (bridge/runopts.py)
        con.print(escape(line))
    render_ledger(plan.ledger, con)
    for f in [*plan.report.warnings, *plan.report.errors]:
        con.print(f"[{STYLE[f.level]}]{f.level}[/] {escape(f'[{f.code}]')} {escape(f.message)}")
    con.print("[green]audit: OK[/]" if plan.report.ok else f"[red]audit: {len(plan.report.errors)} error(s)[/]")


def recipes_table(rows: list[dict]) -> Table:
    t = Table(title="H100 recipes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = {"recipe": "recipe", "model": "model", "GPUs": "gpus", "dtype": "dtype", "TP/PP/CP/VP/EP/DP": "layout"}
    cols |= {"MBS/GBS": "batch", "seq": "seq", "overlaps on": "on", "TFLOP/s*": "tflops", "audit": "audit"}
    for col in cols:
        t.add_column(col, no_wrap=True, justify="right" if col == "TFLOP/s*" else "left")
    for r in rows:
        t.add_row(*(str(r[k]) for k in cols.values()))
    return t


def legend() -> str:
    """`make recipes`' key to its labels: the rows of one profile class (RS/AG, both DP's) share one entry."""
    groups = [list(g) for _, g in itertools.groupby(Overlap, key=lambda o: o.klass or o)]
    entries = [f"{'/'.join(o.label for o in g)} = {' / '.join(o.what for o in g)}" for g in groups]
    return "overlaps: " + ", ".join(entries)


def overlap_summary(report) -> str:
    """The short labels (spec/overlap.py) of the overlaps that are on, in the audit's order: `make recipes`' column."""
    return " ".join(Overlap(r.name).label for r in report.rows if r.name in LABELLED and r.state == "on")


def ledger_rows(ledger) -> list[tuple[str, str, str, str, str]]:
    """(variable, value, layer, lower layers that also set it, reason) per entry of an env.Ledger."""
    return [
        (e.name, e.value, e.layer, ", ".join(f"{la}={v}" for la, v in e.overridden), e.reason) for e in ledger.entries
    ]


def render_ledger(ledger, con: Console) -> None:
    t = Table(title=f"Launch environment (precedence: {' < '.join(LAYERS)})", title_justify="left")
    for col in ("variable", "value", "layer"):
        t.add_column(col, no_wrap=True)
    t.add_column("why (and what it replaced)")
    for name, value, layer, lower, reason in ledger_rows(ledger):
        t.add_row(*(escape(c) for c in (name, value, layer, reason + (f" [over {lower}]" if lower else ""))))
    con.print(t)
    for c in ledger.conflicts:
        con.print(f"[{STYLE[c.level]}]{c.level}[/] {escape(f'[env:{c.name}]')} {escape(c.message)}")
    for s in ledger.shell_overrides:
        con.print(f"[yellow]shell[/] {escape(s.message)}")
    for name in ledger.missing_secrets:
        con.print(f"[yellow]secret[/] {escape(name)} is not set in this shell: export it before submitting")
