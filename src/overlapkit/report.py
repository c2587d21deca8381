"""Human-readable rendering (rich) of plans, audits and the recipe list."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from overlapkit import memory

STYLE = {"on": "green", "off": "red", "n/a": "dim"}


def console(file=None, width: int | None = None) -> Console:
    con = Console(file=file, width=width, highlight=False, soft_wrap=False)
    if width is None and not con.is_terminal:
        con.width = 120  # piped or in CI: wide enough for the overlap table without wrapping every row
    return con


def audit_table(report) -> Table:
    t = Table(title="Overlap stack (resolved by Bridge for this target)", title_justify="left", expand=False)
    t.add_column("overlap")
    t.add_column("state")
    t.add_column("why")
    for r in report.rows:
        t.add_row(r.name, f"[{STYLE.get(r.state, '')}]{r.state}[/]", escape(r.detail))
    return t


def layout_line(layout: dict) -> str:
    vpp = layout["vpp"] or "-"
    return (
        f"{layout['gpus']} GPUs = {layout['nodes']} nodes × 8 · TP{layout['tp']} PP{layout['pp']} CP{layout['cp']} "
        f"VP{vpp} DP{layout['dp']} · MBS {layout['mbs']} GBS {layout['gbs']} · seq {layout['seq']} · "
        f"{layout['dtype']} · {layout['params_b']}B params"
    )


def render_plan(plan, con: Console) -> None:
    d = plan.to_dict()
    con.print(f"[bold]{d['recipe']}[/]  {d['layout']['model']}")
    con.print(f"source: {escape(d['source'])}")
    con.print(layout_line(d["layout"]))
    for o in d["overrides"]:
        con.print(escape(f"override: {o['key']} = {o['new']} (was {o['old']})"))
    con.print(audit_table(plan.report))
    est = plan.memory
    con.print(memory.table(est))
    con.print(escape(est.summary()))
    if plan.ledger is not None:
        plan.ledger.render(con)
    for f in plan.report.warnings:
        con.print(f"[yellow]warning[/] {escape(f'[{f.code}]')} {escape(f.message)}")
    for f in plan.report.errors:
        con.print(f"[red]error[/] {escape(f'[{f.code}]')} {escape(f.message)}")
    verdict = "[green]audit: OK[/]" if plan.report.ok else f"[red]audit: {len(plan.report.errors)} error(s)[/]"
    con.print(verdict)


def recipes_table(rows: list[dict]) -> Table:
    t = Table(title="H100 recipes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("recipe", "model", "GPUs", "dtype", "TP/PP/CP/VP/DP", "MBS/GBS", "seq", "overlaps on", "audit"):
        t.add_column(col, no_wrap=True)
    for r in rows:
        t.add_row(*(str(r[k]) for k in ("recipe", "model", "gpus", "dtype", "layout", "batch", "seq", "on", "audit")))
    return t


# Short names for the recipe list: TP userbuffers, pipeline p2p, DP reduce-scatter, DP all-gather, FP8 all-gather.
SHORT = {
    "tp_comm_overlap": "TP",
    "overlap_p2p_comm": "P2P",
    "overlap_grad_reduce": "RS",
    "overlap_param_gather": "AG",
    "fp8_param_gather": "FP8-AG",
}


def overlap_summary(report) -> str:
    return " ".join(SHORT[r.name] for r in report.rows if r.name in SHORT and r.state == "on")
