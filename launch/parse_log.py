"""`make parse-log LOG=<training log>`: the log as JSON (overlapkit/nightly/logparse.py), written one record at a
time. A path that is missing, not a file or binary is bad input (exit 2); a log without an iteration line is one
`error:` line, no JSON and exit 1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.args import Parser
from overlapkit.errors import BadInput
from overlapkit.nightly import logparse

GIVE = "(give LOG=<path to a training log>)"


def parse(argv):
    p = Parser(prog="make parse-log", description="Bridge training log → JSON")
    p.add_argument("log", nargs="?", default=None, help="the log (or --log=PATH, for a path starting with -)")
    p.add_argument("--log", dest="log_option", default=None)
    p.add_argument("--warmup", default=str(logparse.WARMUP_ITERS))
    return p.parse_args(argv)


def check(args) -> bool:
    given = args.log_option if args.log_option is not None else args.log
    if not given:
        raise BadInput(f"LOG= is empty {GIVE}")
    if not args.warmup.strip().isdigit():
        raise BadInput(f"argument --warmup: {args.warmup!r} is not a whole number >= 0 {GIVE}")
    args.log = Path(given)
    return False


def run(args) -> int:
    log = args.log
    try:
        # Before reading it through: missing, a directory, or binary (a NUL byte: no training log prints one).
        why = None if log.is_file() else "not a file" if log.exists() else "no such file"
        if why is None:
            with log.open("rb") as f:
                why = "binary (NUL bytes), not a training log" if b"\0" in f.read(64 << 10) else None
        if why:
            raise BadInput(f"LOG={log}: {why} {GIVE}")
        parsed = logparse.parse_files([log], int(args.warmup), lazy=True)
        if not parsed["iterations"]:
            said = ", ".join(sorted(parsed["events"]))
            said = f"; it reports {said} before any iteration" if said else ""
            print(
                f"error: LOG={log}: no training iterations found (Bridge and Megatron-LM print ' iteration   10/  "
                f"100 | ... |' once per log interval){said}: give a training job's log (make logs RUN=...)",
                file=sys.stderr,
            )
            return 1
        logparse.write_json(parsed, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:  # `make parse-log ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        raise BadInput(f"LOG={log}: {exc.strerror or exc} (give LOG=<a readable training log>)") from exc
    return 0
