"""The nightly report's plots (matplotlib, Agg backend: the report job runs on a headless batch node)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from overlapkit import jsonio


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def draw(out_dir: Path, results: list[dict], history: list[dict]) -> dict[str, str]:
    """{title: png path}: one loss-vs-golden plot per recipe that trained, and one step-time history plot.
    A plot with nothing to show is not drawn (a preflight-only night has no losses or step times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {}
    for res in results:
        pts = [(i, v) for i, v in res.get("losses") or [] if _finite(v)]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
        ax.plot(*zip(*pts, strict=True), label="tonight", color="tab:blue")
        gold = res.get("golden") or {}
        gpts = sorted((int(k), v) for k, v in (gold.get("loss") or {}).items() if _finite(v))
        if gpts:
            ax.plot(*zip(*gpts, strict=True), label="golden", color="black", linestyle="--")
        ax.set(title=f"{res['recipe']}: lm loss", xlabel="iteration", ylabel="lm loss")
        ax.legend()
        ax.grid(alpha=0.3)
        plots[f"{res['recipe']} loss vs golden"] = _save(fig, out_dir / f"loss_{res['recipe']}.png")
    series: dict[str, list] = {}
    for rec in history:
        if _finite(rec.get("step_time_ms")):
            series.setdefault(rec["recipe"], []).append((rec["night"], rec["step_time_ms"]))
    if series:
        nights = sorted({n for pts in series.values() for n, _ in pts})
        fig, ax = plt.subplots(figsize=(7, 3.8), dpi=80)
        for recipe, pts in sorted(series.items()):
            ax.plot([nights.index(n) for n, _ in pts], [v for _, v in pts], marker="o", label=recipe)
        ax.set_xticks(range(len(nights)), nights, rotation=30, ha="right", fontsize=7)
        ax.set(title="steady-state step time per night", ylabel="ms / iteration")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        plots["step time history"] = _save(fig, out_dir / "step_time_history.png")
    return plots


def _save(fig, path: Path) -> str:
    """The PNG rendered in memory and closed, then written atomically (never through a link planted at `path`)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return str(jsonio.write_text(path, buf.getvalue()))
