"""`make overlap-report`: how much of each class of communication the overlaps hid, from the run's own profile
(Nsight Systems' SQLite export or the PyTorch profiler's trace), and the plan's overlap claims checked against it
(docs/overlap_report.md).

RUN=<run dir> reads the run's plan.json and its nsys/ or torch_profile/ profiles (NODES=, SET= and GPU= are refused
there, RECIPE= ignored: the run's plan is the one it ran with); PROFILE=<file or dir> with RECIPE= (SET=, NODES=,
GPU=) plans the recipe as `make plan` does. The timeline PNG goes where the report's JSON goes: into the run
directory for RUN=, the current folder for PROFILE= (never the profiles' folder, which may be shared or read-only),
or PNG=<name>.png; a file already there that this command did not write is replaced only with FORCE=1. Exit status: 0
when the claims hold, 1 when a finding is an error, 2 for bad input (a missing, empty, corrupt or foreign file; an
unknown recipe; a bad SET; a PNG= that is not a .png name or would replace the user's file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launch.args import Parser, add_gpu_option
from overlapkit import paths
from overlapkit.errors import BadInput, one_line
from overlapkit.profile.nsys_sqlite import profile_files
from overlapkit.profile.overlap_render import png_target
from overlapkit.spec.runopts import OVERLAP_JSON, OVERLAP_PNG, switch


def parse(argv):
    p = Parser(prog="make overlap-report", description=__doc__)
    p.add_argument("--run", default="", help="a run directory (runs/<recipe>-<time>) with its profiles in nsys/")
    p.add_argument(
        "--profile", default="", help="an .sqlite / .nsys-rep export or a PyTorch trace (.json, .json.gz), or a dir"
    )
    p.add_argument("--recipe", default="", help="the recipe the profiled run was planned from (with --profile)")
    p.add_argument("--nodes", default="", help="8-GPU nodes of the profiled run (default: the recipe's)")
    p.add_argument("--set", default="", help="the SET overrides of the profiled run")
    add_gpu_option(p)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--png", default="", help="where the timeline PNG goes (default: the run dir, or this folder)")
    p.add_argument("--force", type=switch, default="", help="1: PNG= may replace a file this command did not write")
    return p.parse_args(argv)


def _run_dir(text: str) -> Path:
    """RUN= as a path, or as the name of a run directory under runs/ (paths.runs_root())."""
    path, named = Path(text), paths.runs_root() / text
    return named if not path.exists() and named.is_dir() else path


def check(args) -> bool:
    """Everything checked before the Bridge import: which input, the profiles' presence, the request. PROFILE= plans
    the recipe (Bridge); RUN= reads the run's plan.json and needs none."""
    if args.run and args.profile:
        raise BadInput("give RUN=<run dir> or PROFILE=<file or dir> RECIPE=<name>, not both")
    if not args.run and not args.profile:
        raise BadInput("nothing to report: give RUN=<run dir> or PROFILE=<file or dir> RECIPE=<name>")
    args.files = args.request = None
    # the picture goes where the report's JSON goes: the run directory (its own name there, replaced freely), or
    # the current folder for PROFILE=; never beside the profiles (a shared or read-only folder)
    own = str(_run_dir(args.run) / OVERLAP_PNG) if args.run else str(Path.cwd() / OVERLAP_PNG)
    args.png_path = png_target(args.png or own, force=args.force, own=bool(args.run and not args.png))
    if args.run:
        # RECIPE= has the Makefile's default, so it cannot be told from one typed: it is ignored here, as documented
        if given := [k.upper() + "=" for k in ("nodes", "set", "gpu") if getattr(args, k).strip()]:
            raise BadInput(
                f"RUN= reports the run with the plan it ran with (its plan.json): {', '.join(given)} would not "
                "apply; drop them, or give PROFILE=<its profiles> RECIPE=... to plan another way"
            )
        return False
    from overlapkit.bridge import request

    args.files = profile_files(Path(args.profile), skip=(OVERLAP_JSON,))
    args.request = request.parse(args.recipe, args.nodes, args.set, action="overlap-report", gpu=args.gpu)
    return True


def run(args) -> int:
    from overlapkit.profile import overlap_render, overlap_report

    if args.request is None:  # RUN=: the run's own plan and profiles; the report and its picture go into it
        run_dir = _run_dir(args.run)
        files, plan = overlap_report.run_inputs(run_dir)
    else:  # PROFILE=: the recipe planned as make plan does
        from overlapkit.bridge import stack
        from overlapkit.bridge.build import plan_for

        stack.import_bridge()
        plan = plan_for(args.request).to_dict()
        files, run_dir = args.files, None
    report, warning = overlap_report.write(files, plan, args.png_path, run_dir)
    if warning:
        print(f"warning: {one_line(warning)}: give PNG=<path>", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        overlap_render.render(report, overlap_render.console())
    errors = [f for f in report["findings"] if f["level"] == "error"]
    for f in errors:
        print(one_line(f"error: [{f['code']}] {f['message']}"), file=sys.stderr)
    return 1 if errors else 0
