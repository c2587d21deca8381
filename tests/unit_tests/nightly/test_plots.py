"""The nightly report's plots: one loss plot per recipe that trained, a step-time history plot, nothing for a
night with nothing to show."""

from __future__ import annotations

from pathlib import Path

from overlapkit.nightly import plots


def test_draws_loss_and_history_and_skips_empty(tmp_path):
    results = [{"recipe": "a", "losses": [(1, 11.0), (2, 10.0), (3, float("nan"))], "golden": None},
               {"recipe": "b", "losses": []}]  # fmt: skip
    history = [{"night": n, "recipe": "a", "step_time_ms": t} for n, t in (("n1", 2000.0), ("n2", 2100.0))]
    drawn = plots.draw(tmp_path, results, history)
    assert len(drawn) == 2 and all(p.endswith(".png") for p in drawn.values())
    assert all(Path(p).parent == tmp_path and Path(p).stat().st_size > 1000 for p in drawn.values())
    assert plots.draw(tmp_path / "empty", [{"recipe": "b", "losses": []}], []) == {}
