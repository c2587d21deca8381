"""What a candidate stack changes in every recipe: a diff of two sets of plan records (bridge/stackplan.py wrote them,
one process per stack). Records only: nothing here imports Bridge, so the nightly and CI read a diff as data.

Per recipe: the overlap rows that flip, the launch variables and config fields that changed (a field gone with the
nearest new name), the audit findings new or gone, the memory and the predicted step time, and one verdict:
unchanged, changed, or fails to plan (with the first error).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

UNCHANGED, CHANGED, FAILS = "unchanged", "changed", "fails to plan"
ABSENT = "(no such field)"  # a field one stack's config does not have (None is a value)
STEP_NOISE = 0.0005  # a step time within 0.05 %: rounding of the record, not a change


def overlap_flips(a: dict, b: dict) -> list[dict]:
    ra, rb = (rec.get("audit", {}).get("rows", {}) for rec in (a, b))
    return [
        {"row": n, "pinned": ra.get(n), "candidate": rb.get(n)}
        for n in sorted(set(ra) | set(rb), key=lambda n: (n not in ra, n))
        if (ra.get(n) or {}).get("state") != (rb.get(n) or {}).get("state")
    ]


def env_changes(a: dict, b: dict) -> list[dict]:
    """Each launch variable added, removed or changed: its value and layer on each side (None where absent)."""
    ea, eb = ({e["name"]: e for e in (rec.get("env") or {}).get("env", [])} for rec in (a, b))
    out = []
    for name in sorted(set(ea) | set(eb)):
        pa, pb = ((e["value"], e["layer"]) if e else None for e in (ea.get(name), eb.get(name)))
        if pa != pb:
            kind = "added" if pa is None else "removed" if pb is None else "changed"
            side = lambda p: {"value": p[0], "layer": p[1]} if p else None  # noqa: E731
            out.append({"name": name, "change": kind, "pinned": side(pa), "candidate": side(pb)})
    return out


def config_changes(a: dict, b: dict) -> dict:
    """Fields whose value changed, fields gone (with the nearest field the candidate added in the same section),
    fields new, and what a recipe sets that is no field under the candidate."""
    ca, cb = a.get("config", {}), b.get("config", {})
    both = sorted(ca.keys() & cb.keys())
    changed = [{"field": k, "pinned": ca[k], "candidate": cb[k]} for k in both if ca[k] != cb[k]]
    new = sorted(cb.keys() - ca.keys())
    gone = []
    for k in sorted(ca.keys() - cb.keys()):
        section = k.rsplit(".", 1)[0] + "."
        near = difflib.get_close_matches(k, [n for n in new if n.startswith(section)], n=1, cutoff=0.6)
        gone.append({"field": k, "pinned": ca[k], "nearest": near[0] if near else None})
    was = a.get("not_fields", {})
    not_fields = [{"field": k, "why": why} for k, why in sorted(b.get("not_fields", {}).items()) if k not in was]
    return {"changed": changed, "gone": gone, "new": new, "not_fields": not_fields}


def bridge_changes(a: dict, b: dict) -> list[dict]:
    """Fields of Bridge's own recipe function's config (before the recipe tunes it) whose value changed, each with
    whether the resolved plan still differs there (False: the recipe sets the field itself)."""
    ba, bb = (r.get("bridge_config") or {} for r in (a, b))
    if "error" in ba or "error" in bb:
        errors = {"pinned": ba.get("error"), "candidate": bb.get("error")}
        return [{"field": "(recipe function)", **errors, "reaches": None}]
    fa, fb = ba.get("fields", {}), bb.get("fields", {})
    ca, cb = a.get("config", {}), b.get("config", {})
    return [
        {"field": k, "pinned": fa.get(k, ABSENT), "candidate": fb.get(k, ABSENT), "reaches": ca.get(k) != cb.get(k)}
        for k in sorted(fa.keys() | fb.keys())
        if fa.get(k, ABSENT) != fb.get(k, ABSENT)
    ]


def _findings(rec: dict) -> set:
    audit = rec.get("audit", {})
    return {(f["level"], f["code"], f["message"]) for f in audit.get("errors", []) + audit.get("warnings", [])}


def audit_changes(a: dict, b: dict) -> dict:
    fa, fb = _findings(a), _findings(b)
    as_dict = lambda fs: [{"level": lv, "code": c, "message": m} for lv, c, m in sorted(fs)]  # noqa: E731
    return {"new": as_dict(fb - fa), "gone": as_dict(fa - fb)}


def sizing_change(a: dict, b: dict) -> dict:
    """Memory (GB per GPU) and the predicted step (s) on each side; the step's relative change and whether it falls
    inside the calibration's band (None where the constants have none: the published ones)."""
    ma, mb = a["memory"]["total_gb"], b["memory"]["total_gb"]
    ta, tb = (a.get("throughput") or {}), (b.get("throughput") or {})
    sa, sb = ta.get("step_time_s"), tb.get("step_time_s")
    rel = (sb / sa - 1) if sa and sb else None
    band = tb.get("band")
    inside = None if band is None or rel is None else band["low"] <= rel <= band["high"]
    return {
        "memory_gb": {"pinned": ma, "candidate": mb, "delta": round(mb - ma, 2)},
        "step_s": {"pinned": sa, "candidate": sb, "change": None if rel is None else round(rel, 4)},
        "band": band,
        "inside_band": inside,
    }


def diff_recipe(name: str, a: dict | None, b: dict | None) -> dict:
    """One recipe's diff (a: pinned record, b: candidate record; None where the side has no such recipe)."""
    known = a if a and "error" not in a else b if b and "error" not in b else {}
    head = {"recipe": name, "source": known.get("source"), "layout": known.get("layout")}  # the pinned's, if it plans
    for side, rec in (("pinned", a), ("candidate", b)):
        if rec is None or "error" in rec:
            err = "no such recipe under this stack" if rec is None else rec["error"]
            return {**head, "verdict": FAILS, "side": side, "error": err, "audit_ok": False}
    d = {
        **head,
        "overlaps": overlap_flips(a, b),
        "env": env_changes(a, b),
        "config": config_changes(a, b),
        "bridge_recipe": bridge_changes(a, b),
        "audit": audit_changes(a, b),
        "sizing": sizing_change(a, b),
        "audit_ok": b["audit"]["ok"],
    }
    step = d["sizing"]["step_s"]["change"]
    moved = d["sizing"]["memory_gb"]["delta"] != 0 or (step is not None and abs(step) > STEP_NOISE)
    cfg = d["config"]
    any_change = d["overlaps"] or d["env"] or cfg["changed"] or cfg["gone"] or cfg["not_fields"]
    d["verdict"] = CHANGED if any_change or d["audit"]["new"] or d["audit"]["gone"] or moved else UNCHANGED
    return d


def diff(pinned: dict, candidate: dict) -> dict:
    """Both stacks' planner outputs (bridge/stackplan.plan_all) → the whole diff."""
    ra = {r["recipe"]: r for r in pinned["records"]}
    rb = {r["recipe"]: r for r in candidate["records"]}
    recipes = [diff_recipe(n, ra.get(n), rb.get(n)) for n in sorted(ra.keys() | rb.keys())]
    return {
        "pinned": pinned["versions"],
        "candidate": candidate["versions"],
        "load_errors": {"pinned": pinned.get("load_errors", []), "candidate": candidate.get("load_errors", [])},
        "recipes": recipes,
    }


def exit_status(d: dict) -> int:
    """0: every recipe plans under both stacks with a clean candidate audit, else 1."""
    return 0 if all(r["audit_ok"] for r in d["recipes"]) else 1


def _v(x) -> str:
    return x if x == ABSENT else repr(x) if isinstance(x, str) else str(x)


def recipe_lines(r: dict) -> list[str]:
    """The text report of one recipe: its verdict line, then what differs (nothing for an unchanged one)."""
    if r["verdict"] == FAILS:
        return [f"{r['recipe']}: fails to plan under the {r['side']} stack: {r['error']}"]
    counts = [
        f"{len(r['overlaps'])} overlap row(s)" if r["overlaps"] else "",
        f"{len(r['env'])} env var(s)" if r["env"] else "",
        f"{len(r['config']['changed'])} config field(s)" if r["config"]["changed"] else "",
        f"{len(r['config']['gone'])} field(s) gone" if r["config"]["gone"] else "",
        "audit" if r["audit"]["new"] or r["audit"]["gone"] else "",
        f"{len(r['bridge_recipe'])} field(s) of Bridge's recipe function" if r.get("bridge_recipe") else "",
    ]
    head = f"{r['recipe']}: {r['verdict']}" + (f" ({', '.join(c for c in counts if c)})" if any(counts) else "")
    out = [head]
    for f in r["overlaps"]:
        side = lambda s: f"{s['state']} ({s['detail']})" if s else "absent"  # noqa: E731
        out.append(f"  overlap {f['row']}: {side(f['pinned'])} -> {side(f['candidate'])}")
    for e in r["env"]:
        side = lambda s: f"{s['value']} [{s['layer']}]" if s else "unset"  # noqa: E731
        out.append(f"  env {e['name']} {e['change']}: {side(e['pinned'])} -> {side(e['candidate'])}")
    cfg = r["config"]
    out += [f"  config {c['field']}: {_v(c['pinned'])} -> {_v(c['candidate'])}" for c in cfg["changed"]]
    for g in cfg["gone"]:
        near = f"; nearest new field: {g['nearest']}" if g["nearest"] else ""
        out.append(f"  config {g['field']} ({_v(g['pinned'])}) no longer exists{near}")
    out += [f"  not a field under the candidate: {n['field']} ({n['why']})" for n in cfg["not_fields"]]
    if cfg["new"]:
        out.append(f"  new config fields: {', '.join(cfg['new'])}")
    out += [f"  audit new {f['level']} [{f['code']}] {f['message']}" for f in r["audit"]["new"]]
    out += [f"  audit gone {f['level']} [{f['code']}] {f['message']}" for f in r["audit"]["gone"]]
    for c in r.get("bridge_recipe", []):
        how = "" if c["reaches"] is None else " (reaches the plan)" if c["reaches"] else " (the recipe sets it itself)"
        out.append(f"  Bridge's recipe function: {c['field']}: {_v(c['pinned'])} -> {_v(c['candidate'])}{how}")
    out += sizing_lines(r["sizing"])
    return out


def sizing_lines(s: dict) -> list[str]:
    out, m, st = [], s["memory_gb"], s["step_s"]
    if m["delta"]:
        out.append(f"  memory {m['pinned']:.2f} -> {m['candidate']:.2f} GB/GPU ({m['delta']:+.2f})")
    if st["change"] is not None and abs(st["change"]) > STEP_NOISE:
        band = s["band"]
        where = "no band (published constants)"
        if band:
            where = f"{'inside' if s['inside_band'] else 'outside'} the band {band['low']:+.0%}…{band['high']:+.0%}"
        out.append(f"  predicted step {st['pinned']:.3f} -> {st['candidate']:.3f} s ({st['change']:+.1%}, {where})")
    return out


def render(d: dict) -> str:
    """The text report: the two stacks, then each recipe's verdict and differences, then a summary line."""
    fmt = lambda v: ", ".join(f"{k} {x}" for k, x in sorted(v.items()))  # noqa: E731
    lines = [f"pinned:    {fmt(d['pinned'])}", f"candidate: {fmt(d['candidate'])}"]
    for p in d.get("packages", []):
        lines.append(f"  package {p['package']}: {p['pinned'] or 'absent'} -> {p['candidate'] or 'absent'}")
    for side, errs in d["load_errors"].items():
        lines += [f"{side}: recipe module does not import: {e}" for e in errs]
    lines.append("")
    for r in d["recipes"]:
        lines += recipe_lines(r)
    verdicts = [r["verdict"] for r in d["recipes"]]
    summary = ", ".join(f"{verdicts.count(v)} {v}" for v in (UNCHANGED, CHANGED, FAILS) if v in verdicts)
    lines += ["", f"{len(verdicts)} recipes: {summary or 'none'}"]
    return "\n".join(lines)


NIGHT_FILE = "stackdiff.json"  # what `make nightly STACK=` writes into the night directory


def night_section(night_dir: Path | None, results: list[dict]) -> list[str]:
    """The night report's section for a night run with STACK=: each recipe's measured run beside what the candidate
    stack changes in its plan (nothing when the night had no STACK=)."""
    path = night_dir / NIGHT_FILE if night_dir else None
    if path is None or not path.is_file():
        return []
    d = json.loads(path.read_text())
    measured = {r["recipe"]: r for r in results}
    lines = [
        f"## Candidate stack `{d['stack']}`: what it changes in each plan",
        "",
        "| recipe | measured tonight (status, step ms) | candidate plan |",
        "|---|---|---|",
    ]
    for r in d["recipes"]:
        res = measured.get(r["recipe"]) or {}
        step = ((res.get("summary") or {}).get("step_time_ms")) if res else None
        status = (res.get("verdict") or {}).get("status") or res.get("skipped") or "not run tonight"
        got = f"{status}, {step:.1f}" if step is not None else status
        diff_cell = "<br>".join(ln.strip().replace("|", "\\|") for ln in recipe_lines(r))
        lines.append(f"| {r['recipe']} | {got} | {diff_cell} |")
    return [*lines, ""]
