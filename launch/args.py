"""The one argument parser of the entry points: a bad argument is one line on stderr and exit 2 (bad input), like
every other bad request, instead of argparse's usage block."""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The run options every entry that builds a run takes (make plan, submit, sbatch, run-local): RUN_NAME,
    SEGMENTS, NSYS, NSYS_RANKS, DATA; overlapkit.plan.runopts.parse checks them."""
    p.add_argument("--run-name", default="", help="checkpoints in <job_dir>/checkpoints/<name>; resume from them")
    p.add_argument("--segments", default="", help="N chained jobs (afterany), each resuming from the last")
    p.add_argument("--nsys", default="", help="<start>:<end>: Nsight Systems on those iterations")
    p.add_argument("--nsys-ranks", default="", help="ranks Nsight profiles (default 0)")
    p.add_argument("--data", default="", help="a data.toml (make prep-data); default: mock data")
    add_gpu_option(p)


def add_gpu_option(p: argparse.ArgumentParser) -> None:
    """GPU=: what memory and throughput are sized for (overlapkit.sizing.hardware: h100, h200)."""
    p.add_argument("--gpu", default="", help="GPU the run executes on: h100 (default) or h200")


RUN_OPTIONS = ("run_name", "segments", "nsys", "nsys_ranks", "data")  # add_run_options' destinations


def run_text(args) -> dict:
    """The run options as typed, by overlapkit.plan.runopts.parse's keywords."""
    return {k: getattr(args, k) for k in RUN_OPTIONS}


def request_of(args, *, listing: bool = False, action: str = "plan"):
    """The request (overlapkit.plan.request.PlanRequest) from an entry's arguments (--recipe or the positional
    recipe, --nodes, --set and the run options), every check made before the Bridge import; not yet bound."""
    from overlapkit.plan import request

    return request.parse(
        args.recipe, args.nodes, args.set, run_text(args), listing=listing, action=action, gpu=args.gpu
    )
