"""`make plan` / `make recipes`: build a recipe, apply overrides, resolve and audit its overlap stack. No GPU needed.

Exit status: 0 when the audit has no errors, 1 when it has, 2 for bad input (unknown recipe/key, bad value, NODES).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launch.args import Parser, add_run_options, request_of
from overlapkit import stack
from overlapkit.serve import client as serve_client

ROOT = stack.REPO_ROOT


def _args(argv):
    p = Parser(prog="make plan", description=__doc__)
    p.add_argument("recipe", nargs="?", help="recipe name (make recipes lists them)")
    p.add_argument("--nodes", default="", help="8-GPU nodes (default: the recipe's); rescales data parallelism")
    p.add_argument("--set", default="", help='dotted overrides, e.g. "train.global_batch_size=512"')
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="where run directories go")
    p.add_argument("--list", action="store_true", help="list every recipe")
    p.add_argument("--cluster", default="local", help="profile whose job_dir holds RUN_NAME's checkpoints")
    add_run_options(p)
    return p.parse_args(argv)


def list_recipes(con, gpu: str, cluster: str | None = None) -> int:
    from overlapkit.plan import registry
    from overlapkit.plan.build import make_plan
    from overlapkit.plan.report import overlap_summary, recipes_table
    from overlapkit.sizing import calibration
    from overlapkit.sizing.hardware import DEFAULT_GPU, HARDWARE

    rows, broken = [], []
    for name in registry.names():
        try:
            p = make_plan(name, gpu=gpu, cluster=cluster)
        except (KeyError, ValueError) as exc:  # a recipe file with a bad size: the others still list
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
    con.print(
        "overlaps: TP = tensor-parallel userbuffers, P2P = pipeline p2p, RS/AG = data-parallel grad "
        "reduce-scatter / param all-gather, FP8-AG = FP8 param all-gather, "
        "EP = expert-parallel all-to-all"
    )
    con.print(
        f"TFLOP/s* = predicted model TFLOP/s per GPU on {HARDWARE[gpu].name} (Bridge's FLOPs count; "
        f"docs/throughput.md; constants: {calibration.for_cluster(cluster).label})"
        + ("" if gpu == DEFAULT_GPU else f"; memory and audit for GPU={gpu}")
    )
    for line in broken:
        print(f"error: {line}", file=sys.stderr)
    return max(_load_errors(), 1 if broken else 0)


def _load_errors() -> int:
    """Recipe modules that failed to import: one line each on stderr, exit 1 (the others were listed or planned)."""
    from overlapkit.plan import registry

    errors = registry.load_errors()
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


def bound_options(args, req):
    """The request on CLUSTER's profile (its job_dir holds the checkpoints; its time limit sets the guards). The plan
    itself is not laid out for that profile (`make submit` does that)."""
    from overlapkit.cluster import submit
    from overlapkit.cluster.profiles import load_profile

    return submit.bind(req, load_profile(args.cluster))


def main(argv=None) -> int:
    args = _args(argv)
    from overlapkit.plan.report import console

    out = console()
    try:
        req = request_of(args, listing=args.list)  # parsed once: every check before the Bridge import
        stack.import_bridge()
        if args.list:
            return list_recipes(console(width=max(out.width, 172)), req.gpu, args.cluster)  # one row per recipe
        from overlapkit.plan import registry
        from overlapkit.plan.build import plan_for, write_run_dir
        from overlapkit.plan.report import render_plan

        plan = plan_for(bound_options(args, req), cluster=args.cluster)
    except (KeyError, ValueError) as exc:  # UnknownRecipe, OverrideError, PresetError, LayoutError, PlanError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = write_run_dir(plan, Path(args.runs))
    if args.format == "json":
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        render_plan(plan, out)
        out.print(f"run directory: {run_dir}", markup=False)
    for f in plan.report.errors:
        print(f"error: [{f.code}] {f.message}", file=sys.stderr)
    for line in registry.load_errors():  # another recipe module is broken: say so, this plan stands
        print(f"warning: {line}", file=sys.stderr)
    return 0 if plan.report.ok else 1


def precheck(argv) -> bool:
    """The request passes every check made before the Bridge import (NODES, the recipe's name, SET, run options)."""

    def check():
        args = _args(argv)
        request_of(args, listing=args.list)  # NODES, the recipe's name, SET, GPU, the run options

    return serve_client.quietly(check)


cli = main  # what the plan server's worker runs: the plain path, unchanged


if __name__ == "__main__":
    # A good request is planned by this checkout's plan server when one answers (launch/plan_server.py: torch and
    # Bridge stay loaded there, our code is imported fresh for every plan); otherwise here, as always, while a
    # server starts for the next one. Bad input is answered here, before any import, server or no server.
    sys.exit(serve_client.run("launch.plan", sys.argv[1:], precheck, main))
