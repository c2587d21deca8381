"""The night's report: each recipe's result against its golden, the Markdown report with plots, and the history.

A night lives in `<profile job_dir>/nightly/<UTC stamp>/`: `night.json` (what was submitted), `report.md`,
`results.json`, `plots/*.png`. Every night's numbers are appended to `<job_dir>/nightly/history.jsonl`. Each run's
exposed communication per overlap class comes from its overlap report and timeline (OVERLAP_JSON, OVERLAP_PNG),
written in the job (profile/profiled.py) or by `make overlap-report RUN=`; a run without them says why.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from pathlib import Path

from overlapkit import jsonio
from overlapkit.cluster import joblog
from overlapkit.nightly import exposed, logparse, stackdiff
from overlapkit.nightly import plots as nightly_plots
from overlapkit.nightly import rules as regress
from overlapkit.spec import planfile
from overlapkit.spec.runopts import OVERLAP_JSON, OVERLAP_PNG, PROFILERS, planned_window

# --- history: append-only JSONL ---------------------------------------------------------------------------------


def append_history(path: Path, records: list[dict]) -> None:
    """Append with O_APPEND and one write() + fsync, never rewriting earlier bytes (as a temp + os.replace would
    every night): a crash can at worst leave a torn last line (read_history skips it), never lose an earlier night."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(logparse._clean(r), sort_keys=True) + "\n" for r in records).encode()
    fd = jsonio.open_lock(path, 0o644, append=True)  # never through a link planted at its name
    try:
        if (size := os.fstat(fd).st_size) and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a previous crash left a torn line: start ours on a fresh one
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_history(path: Path) -> list[dict]:
    """Every whole line; a torn one is skipped. The last record per (night, recipe) wins (a report re-run). A history
    that is not a regular file, or past the log ceiling, is no history (the plots start again), never a hang."""
    try:
        text = jsonio.read_bytes(path, jsonio.LOG_LIMIT).decode("utf-8", "replace")
    except (FileNotFoundError, jsonio.Unreadable):
        return []
    out: dict[tuple, dict] = {}
    for line in text.splitlines():
        try:
            rec = jsonio.loads(line)
        except (ValueError, RecursionError):  # a torn line, or a number out of range: not a record
            continue
        if isinstance(rec, dict) and "night" in rec and "recipe" in rec:
            out[(rec["night"], rec["recipe"])] = rec
    return sorted(out.values(), key=lambda r: (r["night"], r["recipe"]))


# --- one recipe's result ----------------------------------------------------------------------------------------


def evaluate(entry: dict, state: str, logs: list[Path], goldens_dir: Path, preflight_only: bool) -> dict:
    """One row of the report: parsed log, verdict, overlaps from plan.json's audit rows, preflight result."""
    run_dir = Path(entry["run_dir"])
    plan = planfile.read_plan(run_dir)  # what make nightly wrote; edited or broken: one line naming file and field
    rows = (plan.get("audit") or {}).get("rows", {})
    pre = jsonio.read_json(run_dir / "preflight.json")
    logs, unread = joblog.readable(logs)  # a FIFO or device planted among them: said in the row, never a hang
    parsed = logparse.parse_files(logs, exclude=logparse.profiled_iterations(plan)) if logs else None
    error = joblog.first_error(logs)[0] if state.split()[0].rstrip("+") in joblog.FAILED else None
    comm = exposed_of(run_dir, plan, preflight_only)
    predicted = plan.get("throughput") or {}  # sizing/throughput.py; a plan.json from before it has none of its keys
    worth, step_s = predicted.get("overlap_worth"), predicted.get("step_time_s")  # worth: sizing/worth.py
    golden = regress.load_golden(entry["recipe"], goldens_dir)
    verdict = regress.classify(
        parsed,
        state,
        golden,
        preflight_only=preflight_only,
        preflight_ok=bool(pre and pre.get("ok")),
        attempt=entry.get("attempt", 0),
        overlap=(comm.pop("report"), comm["missing"]),
        worth=worth,
    )
    if parsed is not None:
        jsonio.write_text(run_dir / "parsed.json", logparse.to_json(parsed) + "\n")  # what make bless reads
    return {
        "recipe": entry["recipe"],
        "nodes": entry["nodes"],
        "dp": entry.get("dp"),
        "job_id": entry.get("job_id"),
        "state": state,
        "run_dir": str(run_dir),
        "verdict": verdict.to_dict(),
        "summary": parsed["summary"] if parsed else None,
        "losses": [(r["iteration"], r["lm_loss"]) for r in parsed["iterations"] if "lm_loss" in r] if parsed else [],
        "golden": golden,
        "predicted_step_ms": step_s * 1e3 if isinstance(step_s, int | float) else None,
        "predicted_band": predicted.get("band"),
        "overlap_worth": worth,
        "overlaps_on": [k for k, v in rows.items() if v.get("state") == "on"],
        "overlaps_off": [k for k, v in rows.items() if v.get("state") == "off"],
        "preflight": pre,
        "exposed": comm,
        "first_error": error,  # the job failed: the first line of its logs that says why (cluster/joblog.py)
        "unreadable_logs": unread,
    }


def exposed_of(run_dir: Path, plan: dict, preflight_only: bool) -> dict:
    """The run's exposed communication: its overlap report, shares per class and timeline, or why there is none."""
    report, why = exposed.read(run_dir)
    png = run_dir / OVERLAP_PNG
    planned = planned_window(plan.get("run"))
    if report is None:
        if preflight_only:
            why = "preflight only: no training, so no profile"
        elif not planned:
            why = "not profiled: plan.json has no NSYS or TORCH_PROFILE window"
        else:
            folder = PROFILERS[planned[0]][1]
            glob, what = PROFILE_FILES[planned[0]]
            if files := sorted((run_dir / folder).glob(glob)):
                why += f" but {folder}/ has {len(files)} {what}(s): make overlap-report RUN={run_dir}"
            else:
                why += f" and no {what} in {folder}/: the job log says why the profile was not kept"
    found = {"report": report, "shares": exposed.shares(report), "missing": why}
    return found | {"png": str(png) if png.is_file() else None, "steps": planned[1].get("steps") if planned else None}


# What each profiler leaves in its folder of the run directory (profile/profiled.py: exports).
PROFILE_FILES = {"nsys": ("*.sqlite", "SQLite export"), "torch_profile": ("rank-*.json.gz", "PyTorch-profiler trace")}


def vs_prediction(res: dict) -> tuple[str, str | None]:
    """('measured vs predicted' cell, a note when the run is beyond its prediction's band: rules.beyond_band)."""
    pred = res.get("predicted_step_ms")
    measured = (res.get("summary") or {}).get("step_time_ms")
    if pred is None:
        return "—", None
    if measured is None or not math.isfinite(measured) or measured <= 0:
        return f"— (predicted {pred:.0f})", None
    under = 1 - pred / measured  # throughput shortfall: tokens/s measured / predicted = pred / measured
    cell = f"{measured:.0f} vs {pred:.0f} ({-under:+.1%} throughput)"
    band = res.get("predicted_band")
    edge = f"band {band['low']:+.0%}…{band['high']:+.0%} of {band['of']}" if band else "no band in plan.json"
    side = regress.beyond_band(pred, measured, band)
    if side == "under":
        note = f"{under:.0%} under the predicted throughput (step {measured:.0f} ms vs {pred:.0f} ms; {edge})"
        hint = regress.likely_overlap(res.get("overlap_worth"), (measured - pred) / 1e3)
        return f"**{cell}**", note + (f"; the gap {hint}" if hint else "")
    if side == "over":
        return f"**{cell}**", (
            f"{-under:.0%} above the predicted throughput, beyond its {edge}: the calibration no longer describes "
            "this cluster (make calibrate CLUSTER=<profile>)"
        )
    return cell, None


# --- the Markdown report ----------------------------------------------------------------------------------------


def _fmt(value, golden=None, digits=1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—" if value is None else str(value)
    text = f"{value:.{digits}f}"
    if golden:
        text += f" ({(value - golden) / golden:+.1%} vs {golden:.{digits}f})"
    return text


def _row(res: dict, night_dir: Path | None) -> str:
    """One judged run's row: its numbers against the golden and the prediction, the worst loss delta, the exposed
    communication per class (vs the golden's, in points) with its timeline link, the preflight, the notes."""
    v, s, g = res["verdict"], res["summary"] or {}, res["golden"] or {}
    ex, pre = res.get("exposed") or {}, res["preflight"]
    loss = next((c for c in v["checks"] if c["metric"] == "lm_loss"), None)
    loss_cell = f"{loss['delta']:+.2%} @ it {loss['iteration']} (tol ±{loss['tol']:.1%})" if loss else "—"
    if ex.get("shares") is None:
        exposed_cell = f"— ({ex.get('missing') or f'no {OVERLAP_JSON}'})"
    else:
        gold = g.get("exposed_share") or {}
        cells = [
            f"{k} {x:.1%}" + (f" ({(x - gold[k]) * 100:+.1f} pts)" if k in gold else "")
            for k, x in ex["shares"].items()
        ]
        png = ex.get("png")
        link = f"[timeline]({os.path.relpath(png, night_dir) if night_dir else png})" if png else f"no {OVERLAP_PNG}"
        exposed_cell = f"{', '.join(cells) or 'no communication'}; {link}"
    pre_cell = "—"
    if pre is not None:
        errors = pre.get("reaudit_errors") or []
        pre_cell = f"{'OK' if pre.get('ok') else 'FAILED'} {pre.get('ranks_reported')}/{pre.get('world_size')} ranks"
        pre_cell += f", {errors[0]}" if errors else ""
    prediction, under = vs_prediction(res)
    notes = ([under] if under else []) + list(v["reasons"])
    notes += [f"first error: {res['first_error']}"] if res.get("first_error") else []
    notes += [f"log not read: {what}" for what in res.get("unreadable_logs") or []]
    notes = [n.replace("|", "\\|") for n in notes]  # a log's text never splits the table's row
    if res["golden"] is None and regress.NO_GOLDEN not in notes:
        notes.append(regress.NO_GOLDEN)  # said on preflight-only nights too: the gap stays visible
    return (
        f"| {res['recipe']} | {res['nodes']} ({res['dp']}) | **{v['status']}** "
        f"| {_fmt(s.get('step_time_ms'), g.get('step_time_ms'))} | {prediction} "
        f"| {_fmt(s.get('tflops_per_gpu'), g.get('tflops_per_gpu'))} | {loss_cell} "
        f"| {exposed_cell} | {', '.join(res['overlaps_on']) or '—'} | {pre_cell} "
        f"| {'; '.join(notes) or '—'} |"
    )


def render(night: dict, results: list[dict], plots: dict[str, str], night_dir: Path | None = None) -> str:
    """The Markdown report; `night_dir`: where it is written (each run's timeline is linked relative to it)."""
    lines = [
        f"# Nightly regression — {night['stamp']} on `{night['cluster']}`",
        "",
        "Preflight-only night: no training on this machine, so there are no step times or losses to compare."
        if night.get("preflight_only")
        else f"{night.get('iters', regress.NIGHTLY_ITERS)} iterations per recipe, mock data, "
        f"seed {regress.NIGHTLY_SEED}; "
        f"step time/TFLOP/s after {logparse.WARMUP_ITERS} warm-up iterations and without the profiled ones, "
        f"tol ±{regress.PERF_TOL:.0%}; exposed communication per class (exposed / communication time, from the "
        f"profiled steps' {OVERLAP_JSON}), margin ±{exposed.EXPOSED_MARGIN * 100:.0f} points.",
        "",
        "| recipe | nodes (DP) | status | step time ms (vs golden) | step ms measured vs predicted "
        "| TFLOP/s/GPU (vs golden) | loss Δ (worst) | exposed comm per class (vs golden) | overlaps on | preflight "
        "| notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        skipped = f"| {res['recipe']} | — | skipped | — | — | — | — | — | — | — | {res.get('skipped')} |"
        lines.append(skipped if res.get("skipped") else _row(res, night_dir))
    failed = [r["recipe"] for r in results if not r.get("skipped") and not r["verdict"]["ok"]]
    lines += ["", f"**{len(failed)} failing**: {', '.join(failed)}" if failed else "**No failures.**", ""]
    lines += stackdiff.night_section(night_dir, results)  # make nightly STACK=: the candidate's plan diff
    lines += [f"![{title}]({rel})" for title, rel in plots.items()]
    return "\n".join(lines) + "\n"


def write_report(night_dir: Path, night: dict, results: list[dict], history_path: Path) -> Path:
    """The judged runs' history lines, then plots (of the whole history), results.json and report.md (returned)."""
    recorded_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    measured = ("step_time_ms", "tflops_per_gpu", "last_loss")  # of the summary; a history line's keys are sorted
    records = [
        {"night": night["stamp"], "cluster": night["cluster"], "recipe": r["recipe"], "status": r["verdict"]["status"]}
        | {key: (r["summary"] or {}).get(key) for key in measured}
        | {"predicted_step_ms": r.get("predicted_step_ms"), "exposed_share": (r.get("exposed") or {}).get("shares")}
        | {"recorded_at": recorded_at}
        for r in results
        if not r.get("skipped")
    ]
    append_history(history_path, records)
    plots = nightly_plots.draw(night_dir / "plots", results, read_history(history_path))
    rel = {title: str(Path(p).relative_to(night_dir)) for title, p in plots.items()}
    jsonio.write_text(night_dir / "results.json", logparse.to_json(results) + "\n")
    return jsonio.write_text(night_dir / "report.md", render(night, results, rel, night_dir))
