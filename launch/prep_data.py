"""`make prep-data IN= TOKENIZER= OUT= [KEY=text] [WORKERS=1] [FORCE=1]`: JSONL → Megatron .bin/.idx + OUT/data.toml.

Argument parsing and printing only; the work is overlapkit.plan.dataprep (nvidia-modelopt's preprocessor). Exit
status: 0 written, 2 bad input (nothing written), 128+signal when interrupted (Ctrl-C, SIGTERM, SIGHUP, or make
killed: overlapkit.makewatch): no data.toml, and the work directory is removed.
"""

from __future__ import annotations

import os
import signal
import sys

from launch.args import Parser, switch
from overlapkit import makewatch
from overlapkit.errors import one_line
from overlapkit.plan import dataprep


def _args(argv):
    ap = Parser(prog="make prep-data", description=__doc__)
    ap.add_argument("--in", dest="in_path", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--key", default="text")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--force", type=switch, default="", help="1: overwrite existing outputs")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    force = args.force
    try:
        dataprep.check(args.in_path, args.tokenizer, args.out, args.key, args.workers, force)  # before any import
        spec = dataprep.prep(
            args.in_path, args.tokenizer, args.out, args.key, args.workers, force, log=lambda m: print(m, flush=True)
        )
    except (KeyboardInterrupt, makewatch.Interrupted) as exc:
        why = exc if isinstance(exc, makewatch.Interrupted) else "interrupted"
        print(f"error: {why}: no data.toml written; the partial output was removed", file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, makewatch.Interrupted) else 130
    except (ValueError, OSError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    print(f"next: make plan RECIPE=<recipe> DATA={spec}")
    return 0


def cli(argv=None) -> int:
    """The command line (`python -m launch.prep_data`): the handlers, then main; an in-process caller keeps its own.
    Stopped by a signal, the work directory already removed, it exits at once: the interpreter's teardown of torch
    and Megatron Core (imported by the preprocessor) took 12 s on a loaded machine, an orphan all that time."""
    # SIGTERM (make's death too) and SIGHUP unwind like Ctrl-C, so the work directory is removed on the way out;
    # a forked tokenizing worker (WORKERS>1) exits at once, its pool's owner cleaning up
    makewatch.on_signals(signals=(signal.SIGTERM, signal.SIGHUP))
    code = main(argv)
    if code > 128:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(cli())
