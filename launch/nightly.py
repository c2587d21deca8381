"""`make nightly | nightly-report | bless`: the nightly GPU regression suite on a cluster profile.

submit: every recipe (or RECIPES=) in its nightly shape (overlapkit.nightly.shape_for) through the normal launch path
(overlapkit.submit.prepare + submit: audit, env plugin, ledger, preflight), then one summary job that depends on all
of them (afterany) and runs `python -m launch.nightly report`, so it runs last whatever their fate.
report: classify each run against its golden (overlapkit.regress), write report.md + plots, append the history;
resubmit an infrastructure failure once. bless: a reviewed run → nightly/goldens/<recipe>.json.
Exit status: 0 ok, 1 failures, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.metadata as md
import json
import shlex
import subprocess
import sys
from pathlib import Path

from overlapkit import logparse, nightly, regress, stack

VERSIONED = ("megatron-bridge", "megatron-core", "torch", "transformer-engine", "nemo-run")


def _args(argv):
    ap = argparse.ArgumentParser(prog="launch.nightly", description=__doc__)
    ap.add_argument("action", choices=("submit", "report", "bless"))
    ap.add_argument("--cluster", default="local", help="profile name in slurm/profiles/ or a path to a .toml")
    ap.add_argument("--job-dir", default="", help="override the profile's job_dir (tests)")
    ap.add_argument("--dryrun", default="")
    ap.add_argument("--preflight", default="", help="1: preflight-only runs (CPU machines); env: skip the re-audit")
    ap.add_argument("--recipes", default="", help="space/comma-separated names (default: every recipe that fits)")
    ap.add_argument("--iters", default=str(nightly.NIGHTLY_ITERS))
    ap.add_argument("--min-dp", default=str(nightly.MIN_DP))
    ap.add_argument("--max-nodes", default="", help="default: the nodes in the profile's partition (sinfo)")
    ap.add_argument("--night", default="", help="report: the night directory (default: the latest)")
    ap.add_argument("--run", default="", help="bless: the run directory")
    ap.add_argument("--goldens", default=str(regress.GOLDENS_DIR))
    ap.add_argument("--no-retry", action="store_true", help="report: do not resubmit infrastructure failures")
    return ap.parse_args(argv)


def profile_of(args):
    from overlapkit.profiles import load_profile

    p = load_profile(args.cluster)
    return dataclasses.replace(p, job_dir=args.job_dir) if args.job_dir else p


def partition_nodes(partition: str) -> int | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%D"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(x) for x in out.stdout.split() if x.isdigit()]
    return sum(counts) or None


def versions() -> dict:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def do_submit(args) -> int:
    from overlapkit import submit

    profile = profile_of(args)
    preflight = args.preflight.strip().lower()
    preflight_only, checks = preflight in ("1", "env", "full"), "env" if preflight == "env" else "full"
    stack.import_bridge()
    import recipes

    names = args.recipes.replace(",", " ").split() or list(recipes.REGISTRY)
    limit = int(args.max_nodes) if args.max_nodes else partition_nodes(profile.partition)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    night_dir = profile.job_path / "nightly" / stamp
    entries, ids = [], []
    for name in names:
        entry = recipes.get(name)
        with stack.silenced():
            cfg_layout = _layout(entry, entry.build())
        shape = nightly.shape_for(name, cfg_layout, iters=int(args.iters), min_dp=int(args.min_dp))
        row = {**shape.to_dict(), "attempt": 0}
        if limit and shape.nodes > limit:
            row["skipped"] = (f"needs {shape.nodes} nodes at DP={shape.dp} (TP·PP·CP = "
                              f"{cfg_layout['tp'] * cfg_layout['pp'] * cfg_layout['cp']} GPUs); "
                              f"{profile.name} has {limit}")  # fmt: skip
            print(f"skip {name}: {row['skipped']}")
        elif args.dryrun:
            print(f'would submit {name}: nodes={shape.nodes} dp={shape.dp} SET="{shape.sets}"')
        else:
            try:
                sub = submit.prepare(name, profile, nodes=shape.nodes, sets=shape.sets,
                                     preflight_only=preflight_only, checks=checks)  # fmt: skip
            except (submit.SubmitError, ValueError) as exc:
                row["skipped"] = f"not submitted: {exc}"
                print(f"skip {name}: {row['skipped']}", file=sys.stderr)
            else:
                meta = {**row, "preflight_only": preflight_only, "container_image": profile.container_image,
                        "versions": versions(), "night": stamp}  # fmt: skip
                (sub.run_dir / "nightly.json").write_text(json.dumps(meta, indent=2) + "\n")
                info = submit.submit(sub)
                row.update(job_id=info["job_id"], run_dir=str(sub.run_dir))
                ids.append(info["job_id"])
                print(f"submitted {name}: job {info['job_id']} nodes={shape.nodes} dp={shape.dp}")
        entries.append(row)
    if args.dryrun:
        print("dry run: nothing submitted")
        return 0
    night = {"stamp": stamp, "cluster": profile.name, "profile_path": str(profile.path), "job_dir": profile.job_dir,
             "preflight_only": preflight_only, "checks": checks, "iters": int(args.iters), "entries": entries,
             "goldens": args.goldens}  # fmt: skip
    night_dir.mkdir(parents=True, exist_ok=True)
    night["report_job_id"] = submit_report(profile, night_dir, ids)
    _write_json(night_dir / "night.json", night)
    print(f"summary job {night['report_job_id']} runs after {len(ids)} job(s) (afterany); night: {night_dir}")
    return 0


def _layout(entry, cfg) -> dict:
    m = cfg.model
    return {"tp": m.tensor_model_parallel_size, "pp": m.pipeline_model_parallel_size,
            "cp": m.context_parallel_size or 1, "mbs": cfg.train.micro_batch_size,
            "gbs": cfg.train.global_batch_size, "nodes": entry.nodes}  # fmt: skip


def submit_report(profile, night_dir: Path, ids: list[str]) -> str:
    """A plain `sbatch --wrap` (one CPU task): it only reads files and sacct, so it needs no nemo_run packaging."""
    from overlapkit.submit import python_for

    cmd = (f"cd {shlex.quote(str(stack.REPO_ROOT))} && PYTHONPATH=src:. {shlex.quote(python_for(profile))} "
           f"-m launch.nightly report --night {shlex.quote(str(night_dir))}")  # fmt: skip
    argv = ["sbatch", "--parsable", f"--account={profile.account}", f"--partition={profile.partition}",
            "--nodes=1", "--ntasks=1", "--time=00:30:00", "--job-name=nightly-report",
            f"--output={night_dir}/report-%j.out", "--wrap", cmd]  # fmt: skip
    if ids:
        argv.insert(2, f"--dependency=afterany:{':'.join(ids)}")
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch for the summary job failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def latest_night(root: Path) -> Path:
    nights = sorted(root.glob("*/night.json"))
    if not nights:
        raise FileNotFoundError(f"no nights under {root}: run make nightly first, or give NIGHT=<dir>")
    return nights[-1].parent


def do_report(args) -> int:
    from overlapkit import submit

    night_dir = Path(args.night) if args.night else latest_night(profile_of(args).job_path / "nightly")
    night = json.loads((night_dir / "night.json").read_text())
    goldens = Path(night.get("goldens") or args.goldens)
    results, retry = [], []
    for e in night["entries"]:
        if e.get("skipped") or not e.get("job_id"):
            results.append({"recipe": e["recipe"], "skipped": e.get("skipped", "not submitted")})
            continue
        info = submit.load_submission(Path(e["run_dir"]))
        res = nightly.evaluate(e, submit.job_state(e["job_id"]), submit.log_files(info), goldens,
                               night["preflight_only"])  # fmt: skip
        results.append(res)
        if res["verdict"]["retry"] and not args.no_retry:
            retry.append(e)
    job_root = Path(night["job_dir"]) if Path(night["job_dir"]).is_absolute() else stack.REPO_ROOT / night["job_dir"]
    report = nightly.write_report(night_dir, night, results, job_root / "nightly" / "history.jsonl")
    print(report.read_text())
    if retry:
        _retry(night_dir, night, retry)
    return 0 if all(r.get("skipped") or r["verdict"]["ok"] for r in results) else 1


def _retry(night_dir: Path, night: dict, entries: list[dict]) -> None:
    """Infrastructure failures only (regress.classify decides): resubmit once, and a new summary job after them."""
    from overlapkit import submit
    from overlapkit.profiles import load_profile

    stack.import_bridge()
    profile = dataclasses.replace(load_profile(night["profile_path"]), job_dir=night["job_dir"])
    ids = []
    for e in entries:
        sub = submit.prepare(e["recipe"], profile, nodes=e["nodes"], sets=e["sets"],
                             preflight_only=night["preflight_only"], checks=night["checks"])  # fmt: skip
        info = submit.submit(sub)
        e.update(attempt=e.get("attempt", 0) + 1, job_id=info["job_id"], run_dir=str(sub.run_dir))
        ids.append(info["job_id"])
        print(f"retry {e['recipe']} (infrastructure failure): job {info['job_id']}")
    night["report_job_id"] = submit_report(profile, night_dir, ids)
    _write_json(night_dir / "night.json", night)


def do_bless(args) -> int:
    from overlapkit import submit

    run_dir = Path(args.run)
    if not args.run or not run_dir.is_dir():
        raise regress.BlessError(f"RUN={args.run!r}: give RUN=<run directory of a reviewed nightly run>")
    # The job's own logs (nemo_run's experiment directory), plus any *.log put next to plan.json by hand.
    logs = submit.log_files(submit.load_submission(run_dir)) if (run_dir / "submission.json").is_file() else []
    logs += sorted(run_dir.glob("*.log"))
    parsed = logparse.parse_files(logs) if logs else logparse.parse_text("")
    out = regress.bless(run_dir, parsed, Path(args.goldens))
    print(f"blessed {run_dir} -> {out}")
    return 0


def main(argv=None) -> int:
    args = _args(argv)
    try:
        return {"submit": do_submit, "report": do_report, "bless": do_bless}[args.action](args)
    except (regress.BlessError, FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
