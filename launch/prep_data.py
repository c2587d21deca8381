"""`make prep-data IN= TOKENIZER= OUT= [KEY=text] [WORKERS=1] [FORCE=1]`: JSONL → Megatron .bin/.idx + OUT/data.toml.

Argument parsing and printing only; the work is overlapkit.bridge.dataprep (nvidia-modelopt's preprocessor). Exit
status: 0 written, 2 bad input (nothing written), 128+signal when interrupted (Ctrl-C, SIGTERM, SIGHUP, or make
killed: overlapkit.makewatch): no data.toml, and the work directory is removed.
"""

from __future__ import annotations

import functools
import signal
import sys

from launch.args import Parser
from overlapkit import makewatch
from overlapkit.bridge import dataprep
from overlapkit.spec.runopts import switch


def parse(argv):
    ap = Parser(prog="make prep-data", description=__doc__)
    ap.add_argument("--in", dest="in_path", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--key", default="text")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--force", type=switch, default="", help="1: overwrite existing outputs")
    return ap.parse_args(argv)


def check(args) -> bool:
    """IN, TOKENIZER, OUT, KEY, WORKERS and FORCE before any import; never served (it forks its own workers)."""
    dataprep.check(args.in_path, args.tokenizer, args.out, args.key, args.workers, args.force)
    return False


def handlers() -> None:
    """SIGTERM (make's death too) and SIGHUP unwind like Ctrl-C, so the work directory is removed on the way out; a
    forked tokenizing worker (WORKERS>1) exits at once, its pool's owner cleaning up. Stopped by a signal, the command
    exits at once (launch/commands.py): the interpreter's teardown of torch and Megatron Core (imported by the
    preprocessor) took 12 s on a loaded machine, an orphan all that time."""
    makewatch.on_signals(signals=(signal.SIGTERM, signal.SIGHUP))


def run(args) -> int:
    try:
        say = functools.partial(print, flush=True)
        spec = dataprep.prep(args.in_path, args.tokenizer, args.out, args.key, args.workers, args.force, log=say)
    except (KeyboardInterrupt, makewatch.Interrupted) as exc:
        why = exc if isinstance(exc, makewatch.Interrupted) else "interrupted"
        print(f"error: {why}: no data.toml written; the partial output was removed", file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, makewatch.Interrupted) else 130
    print(f"next: make plan RECIPE=<recipe> DATA={spec}")
    return 0
