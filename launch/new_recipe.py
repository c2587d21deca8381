"""`make new-recipe`: fork a recipe for a new model size, pick its layout, write recipes/<name>.py, audit it.

    python -m launch.new_recipe --from llama3_70b_pretrain_64gpu_h100_bf16 --name llama3_34b_pretrain_32gpu_h100_bf16 \\
        --layers 48 --ffn 22016

Shape flags default to the FROM recipe's; GPUs and dtype come from the name (<model>_pretrain_<N>gpu_h100_<dtype>);
layout flags pin part of the layout, the search picks the rest. The file is kept only when the audit is clean and the
memory estimate fits. Exit status: 0 written, 1 the built recipe fails its audit, 2 bad request (one line on stderr,
no file written).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from launch.args import Parser, add_gpu_option, positive_int
from overlapkit import paths
from overlapkit.bridge import registry, stack
from overlapkit.cluster.profiles import load_profile
from overlapkit.fork.scaffold import LAYOUT_FIELDS, SHAPE_FIELDS, ForkRequest, check_request, fork
from overlapkit.sizing import calibration
from overlapkit.sizing.hardware import HARDWARE, parse_gpu


def parse(argv):
    p = Parser(
        prog="make new-recipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, rest=True
    )
    p.add_argument("--from", dest="from_name", required=True, help="recipe to fork (make recipes lists them)")
    p.add_argument("--name", required=True, help="new recipe: <model>_pretrain_<N>gpu_h100_<bf16|fp8cs>")
    for flag in ("hidden", "layers", "heads", "query-groups", "ffn", "seq", "experts", "topk"):
        p.add_argument(f"--{flag}", type=positive_int, help=f"model {flag} (default: the FROM recipe's)")
    p.add_argument("--gpus", type=positive_int, help="GPUs, a multiple of 8 (default: N in the name)")
    p.add_argument("--dtype", choices=("bf16", "fp8cs"), help="default: the name's suffix")
    for flag in ("tp", "pp", "vpp", "cp", "mbs", "ep"):
        p.add_argument(f"--{flag}", type=positive_int, help=f"pin {flag.upper()} (default: searched)")
    p.add_argument("--gbs", type=positive_int, help="global batch size (default: the FROM recipe's)")
    p.add_argument("--model", help='registry label (default from the name, e.g. "Llama3 34B")')
    p.add_argument("--recipes-dir", default=str(paths.REPO_ROOT / "recipes"), help="where the file goes")
    add_gpu_option(p)
    p.add_argument("--cluster", default="local", help="whose calibration (make calibrate) ranks the layouts")
    return p.parse_args(argv)


def check(args) -> bool:
    """GPU=, CLUSTER=, NAME and FROM before the Bridge import (a minute here); the shape and layout need the FROM
    recipe built. The fork request (overlapkit.fork.scaffold, which imports no Bridge) is made from the flags."""
    args.gpu = parse_gpu(args.gpu)
    load_profile(args.cluster)  # CLUSTER= names a profile (its calibration ranks the layouts): a typo is refused
    args.request = ForkRequest(
        **{k: getattr(args, k) for k in ("from_name", "name", "gpus", "dtype", "gbs", "model", "gpu", "cluster")},
        shape={k: getattr(args, k) for k in SHAPE_FIELDS},
        layout={k: getattr(args, k) for k in LAYOUT_FIELDS},
        recipes_dir=Path(args.recipes_dir),
    )
    check_request(args.request)
    return True


def run(args) -> int:
    stack.import_bridge()
    from overlapkit.bridge.report import render_plan
    from overlapkit.profile.overlap_render import console

    res = fork(args.request)
    out = console()
    line = functools.partial(out.print, markup=False, soft_wrap=True)  # one line, never re-wrapped
    line(f"wrote {res.path} (forked from {args.from_name})")
    line(f"layout: {res.choice.describe()}")
    line(f"  why: {res.choice.why}")
    label = calibration.for_cluster(args.cluster).label
    line(
        f"top candidates (ranked by predicted TFLOP/s/GPU on {HARDWARE[args.gpu].name}, constants: {label}; ties by "
        "the layout rules):"
    )
    for i, c in enumerate([res.choice, *res.alternatives], 1):
        p = c.prediction
        pred = f"{p.tflops_per_gpu:.0f} TFLOP/s/GPU, {p.tokens_per_gpu_s:,.0f} tokens/s/GPU, {p.step_s:.2f} s/step"
        line(f"  {i}. {c.describe()}: {pred}; {c.memory.total_gb:.1f} GB" + (f"; loses: {c.loses}" if c.loses else ""))
    render_plan(res.plan, out)  # its memory table and summary included
    if not registry.finds(res.path):
        line(f"note: make plan finds it with {registry.PATH_VAR}={res.path.parent} (it searches recipes/ only)")
    return 0
