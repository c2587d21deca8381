"""Every `make` target's command, in one table, and the one dispatcher that runs them (`python -m launch <name> ...`).

A row names the module of a command and the arguments it always gets (the action of a multi-action module). Each
module says, once each:

- `parse(argv)`: the arguments (launch.args.Parser: a bad flag is one line, exit 2);
- `check(args)`: everything checked before the Bridge import, raising BadInput; True when `run` needs Bridge (the
  plan server may then run it), False when it does not (answered here, at once);
- `run(args)`: the work, returning the exit status;
- optionally `handlers()`: the signal handlers of its command line (an in-process caller keeps its own).

The dispatcher: check → serve (overlapkit/cluster/plan_server.py, when one is on and `check` said Bridge) or
import → run → exit status, by our own error classes only (overlapkit/errors.py): BadInput 2, AuditFailed 1,
ClusterFailure 3, a signal 128+N; anything else is a bug and shows its traceback. To add a command: a module with
those functions, one row below, one Makefile line `@$(PY) -m launch <name> --flag="$$VAR" ...`.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from overlapkit import makewatch
from overlapkit.errors import AuditFailed, BadInput, ClusterFailure, one_line
from overlapkit.makewatch import Interrupted


@dataclass(frozen=True)
class Command:
    module: str
    prefix: tuple[str, ...] = ()  # arguments before the user's: the action of a module with several


COMMANDS = {
    "recipes": Command("launch.plan", ("--list",)),
    "plan": Command("launch.plan"),
    "overlap-report": Command("launch.overlap_report"),
    "new-recipe": Command("launch.new_recipe"),
    "calibrate": Command("launch.calibrate"),
    "submit": Command("launch.submit", ("submit",)),
    "status": Command("launch.submit", ("status",)),
    "logs": Command("launch.submit", ("logs",)),
    "cancel": Command("launch.submit", ("cancel",)),
    "sbatch": Command("launch.submit", ("sbatch",)),
    "run-local": Command("launch.submit", ("run-local",)),
    "prep-data": Command("launch.prep_data"),
    "stack-diff": Command("launch.stack_diff"),
    "nightly": Command("launch.nightly", ("submit",)),
    "nightly-report": Command("launch.nightly", ("report",)),
    "bless": Command("launch.nightly", ("bless",)),
    "parse-log": Command("launch.parse_log"),
    "nightly-schedule": Command("launch.nightly", ("schedule",)),
    "nightly-schedule-run": Command("launch.nightly", ("schedule-run",)),  # what the scheduler job runs
    "nightly-status": Command("launch.nightly", ("schedule-status",)),
    "nightly-unschedule": Command("launch.nightly", ("unschedule",)),
    "plan-server": Command("launch.plan_server", ("serve",)),  # what a client starts
    "plan-server-stop": Command("launch.plan_server", ("stop",)),
    "make-vars": Command("launch.makevars"),  # what the Makefile asks of a command-line variable it lacks
}


def say(exc: BaseException | str, code: int) -> int:
    print(f"error: {one_line(str(exc))}", file=sys.stderr)  # control characters escaped: one line, always
    return code


def prepare(name: str, argv: list[str]):
    """(module, args, needs Bridge) of a command line: parsed and checked, nothing imported for the work yet."""
    if name not in COMMANDS:
        raise BadInput(f"unknown command {name!r}: one of {', '.join(COMMANDS)}")
    cmd = COMMANDS[name]
    module = importlib.import_module(cmd.module)
    args = module.parse([*cmd.prefix, *argv])
    return module, args, module.check(args)


def execute(module, args) -> int:
    """`module.run(args)`'s exit status, our error classes turned into theirs; anything else propagates."""
    try:
        return module.run(args)
    except BadInput as exc:
        return say(exc, 2)
    except AuditFailed as exc:
        return say(exc, 1)
    except ClusterFailure as exc:
        return say(exc, 3)
    except Interrupted as exc:
        return say(exc, 128 + exc.signum)


def call(name: str, argv=()) -> int:
    """A command run in this process (tests, tools): check and run, no server, no signal handlers of its own."""
    try:
        module, args, _ = prepare(name, list(argv))
    except BadInput as exc:
        return say(exc, 2)
    except ClusterFailure as exc:  # a check that asks the cluster (nightly-schedule's AT, by sbatch --test-only)
        return say(exc, 3)
    return execute(module, args)


def main(argv=None) -> int:
    """`python -m launch <name> <args>`: what every Makefile target runs. Every command watches make from its first
    step (overlapkit/makewatch.py: make killed, even by kill -9, stops it, whatever the command) and stops on a signal
    by its module's `handlers`, else by makewatch's one way (Interrupted: it unwinds, writes nothing more)."""
    name, *rest = sys.argv[1:] if argv is None else argv or [""]
    makewatch.watch_make()  # a plan server started from here does not inherit make's pid (plan_server.started)
    try:
        module, args, bridge = prepare(name, rest)
        if bridge:
            from overlapkit.cluster import plan_server

            if (code := plan_server.forward(name, args)) is not None:
                return code
    except BadInput as exc:
        return say(exc, 2)
    except ClusterFailure as exc:  # a check that asks the cluster (nightly-schedule's AT, by sbatch --test-only)
        return say(exc, 3)
    (getattr(module, "handlers", None) or makewatch.on_signals)()
    code = execute(module, args)
    if code > 128:  # stopped by a signal, its work undone: no interpreter teardown of torch (seconds, an orphan)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    return code
