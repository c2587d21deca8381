"""`make plan` / `make recipes`: build a recipe, apply overrides, resolve and audit its overlap stack. No GPU needed.

Exit status: 0 when the audit has no errors, 1 when it has, 2 for bad input (unknown recipe/key, bad value, NODES).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from launch.args import Parser, add_run_options, request_of
from overlapkit import paths
from overlapkit.bridge import stack
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput


def parse(argv):
    p = Parser(prog="make plan", description=__doc__)
    p.add_argument("recipe", nargs="?", help="recipe name (make recipes lists them)")
    p.add_argument("--nodes", default="", help="8-GPU nodes (default: the recipe's); rescales data parallelism")
    p.add_argument("--set", default="", help='dotted overrides, e.g. "train.global_batch_size=512"')
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--runs", default="", help="where run directories go (default: runs/, OVERLAPKIT_RUNS)")
    p.add_argument("--list", action="store_true", help="list every recipe")
    p.add_argument("--cluster", default="local", help="profile whose job_dir holds RUN_NAME's checkpoints")
    add_run_options(p)
    return p.parse_args(argv)


def list_recipes(con, gpu: str, cluster=None) -> int:  # cluster: spec/request.py's Cluster, whose calibration predicts
    from overlapkit.bridge import registry
    from overlapkit.bridge.build import make_plan
    from overlapkit.bridge.report import legend, overlap_summary, recipes_table
    from overlapkit.sizing import calibration
    from overlapkit.sizing.hardware import DEFAULT_GPU, HARDWARE

    rows, broken = [], []
    for name in registry.names():
        try:
            p = make_plan(name, gpu=gpu, cluster=cluster)
        except BadInput as exc:  # a recipe file with a bad size: the others still list
            broken.append(f"{name}: {exc}")
            continue
        lay = p.layout
        rows.append(
            {
                "recipe": name,
                "model": lay["model"],
                "gpus": lay["gpus"],
                "dtype": lay["dtype"],
                "layout": f"{lay['tp']}/{lay['pp']}/{lay['cp']}/{lay['vpp'] or '-'}/{lay.get('ep', 1)}/{lay['dp']}",
                "batch": f"{lay['mbs']}/{lay['gbs']}",
                "seq": lay["seq"],
                "on": overlap_summary(p.report),
                "tflops": f"{p.throughput.tflops_per_gpu:.0f}",
                "audit": "OK" if p.report.ok else f"{len(p.report.errors)} errors",
            }
        )
    con.print(recipes_table(rows))
    con.print(legend())
    con.print(
        f"TFLOP/s* = predicted model TFLOP/s per GPU on {HARDWARE[gpu].name} (Bridge's FLOPs count; "
        f"docs/throughput.md; constants: {calibration.for_cluster(cluster.name if cluster else None).label})"
        + ("" if gpu == DEFAULT_GPU else f"; memory and audit for GPU={gpu}")
    )
    errors = broken + registry.load_errors()  # recipes that failed to plan, then modules that failed to import
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0  # the others were listed


def check(args) -> bool:
    """NODES, the recipe's name, SET, GPU, the run options and CLUSTER's profile, before the Bridge import; every plan
    needs Bridge."""
    req = request_of(args, listing=args.list)  # parsed once: the value run() plans
    # CLUSTER's profile (a typo refused): its calibration predicts, RUN_NAME's checkpoints go under its job_dir, its
    # limit sets the guards. Resolved here, so bridge/ only reads it; bound by plan_for, not laid out for it
    args.request = dataclasses.replace(req, cluster=load_profile(args.cluster).resolved())
    return True


def run(args) -> int:
    from overlapkit.profile.overlap_render import console

    out = console()
    stack.import_bridge()
    if args.list:
        con = console(width=max(out.width, 172))  # one row per recipe, never wrapped
        return list_recipes(con, args.request.gpu, args.request.cluster)
    from overlapkit.bridge import registry
    from overlapkit.bridge.build import plan_for, write_run_dir
    from overlapkit.bridge.report import render_plan

    plan = plan_for(args.request)
    run_dir = write_run_dir(plan, Path(args.runs) if args.runs else paths.runs_root())
    if args.format == "json":
        print(json.dumps(plan.to_dict(run_dir), indent=2))
    else:
        render_plan(plan, out)
        out.print(f"run directory: {run_dir}", markup=False)
    for f in plan.report.errors:
        print(f"error: [{f.code}] {f.message}", file=sys.stderr)
    for line in registry.load_errors():  # another recipe module is broken: say so, this plan stands
        print(f"warning: {line}", file=sys.stderr)
    return 0 if plan.report.ok else 1
