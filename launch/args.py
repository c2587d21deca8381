"""The one argument parser of the entry points: a bad argument is one line on stderr and exit 2 (bad input), like
every other bad request, instead of argparse's usage block.

A value may hold anything but a credential (overlapkit/secrets.py; refused naming the variable, never its value).
The Makefile hands each variable over byte for byte, never expanded (the comment above its DATA_VARS), and nothing
here expands it either, so a value naming a variable or a command (`$HOME`, `${HOME}`, `$(...)`) would be literal
text, never what was meant: it is refused in one line saying to let the shell expand it. Any other `$` is plain text.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

from overlapkit import jsonio
from overlapkit.errors import one_line
from overlapkit.secrets import FIX, credential_kind
from overlapkit.spec.runopts import whole

# What a shell or make would expand: $NAME, ${...}, $(...) (POSIX sh "Parameter Expansion", "Command Substitution";
# GNU make manual "Reference to Variables", "Functions")
EXPANSION = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{|\()")
REST = "--args"  # make's ARGS=: more flags in one string


class Parser(argparse.ArgumentParser):
    """`rest=True`: --args=<text> (make's ARGS=) carries more flags in one string, split as a POSIX shell splits
    words (shlex.split: quotes and backslashes group; nothing is expanded or run) and put where it stood, so
    `ARGS="--model 'Llama3 34B' --tp 4"` is three flags, and a later flag wins over an earlier one as usual."""

    def __init__(self, *args, rest: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.rest = rest
        if rest:
            self.add_argument(REST, default="", metavar="FLAGS", help="more flags in one string (make's ARGS=)")

    def error(self, message):
        fail(f"{message} (--help lists the options)")

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        # A credential-shaped value (overlapkit/secrets.py) in any argument, before argparse could echo it: one line
        # naming the variable, never the value.
        positional = next((a.dest for a in self._actions if not a.option_strings), "an argument")
        for i, token in enumerate(argv):
            if not (kind := credential_kind(token)):
                continue
            if token.startswith("--") and "=" in token:
                flag = token.partition("=")[0]
            elif i and argv[i - 1].startswith("-") and argv[i - 1] != "--" and "=" not in argv[i - 1]:
                flag = argv[i - 1]
            else:
                flag = positional
            fail(
                f"{flag_name(flag)} holds what looks like {kind}: a value here is written to the run's files and "
                f"printed, so a credential never goes in a variable ({FIX})"
            )
        words, i = [] if self.rest else argv, 0  # --args=<text> split where it stood (the class docstring)
        while self.rest and i < len(argv):
            token, i = argv[i], i + 1
            if token == "--":
                words += argv[i - 1 :]
                break
            if token == REST and i < len(argv):
                token, i = f"{REST}={argv[i]}", i + 1
            if not token.startswith(f"{REST}="):
                words.append(token)
                continue
            text = token[len(REST) + 1 :]
            try:
                words += shlex.split(text)
            except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
                fail(f"ARGS={text!r}: {str(exc).lower()} (it is split as a shell splits words: close each quote)")
        ns, extra = super().parse_known_args(words, namespace)
        for action in self._actions:  # a value naming a variable or a command, refused (the module docstring)
            value = getattr(ns, action.dest, None)
            if not isinstance(value, str) or value == action.default or not (m := EXPANSION.search(value)):
                continue
            # the make variable the option stands for: the Makefile names each flag after its variable (--run-name
            # is RUN_NAME=, the positional recipe RECIPE=)
            name, found = flag_name(max(action.option_strings, key=len, default=action.dest)), m.group(0)
            typed = f"{name}={value!r}: {found!r} is passed as typed, never"
            if found == "$(":  # a command (shell) or a function (make): run by neither
                fail(f"{typed} run (make hands its variables over as text): write the value itself")
            quoted = f'{name}="{value}"' if '"' not in value and "\n" not in value else f'{name}="..."'
            fail(
                f"{typed} expanded (make hands its variables over as text): write it out, or let your shell expand "
                f"it: {quoted}"
            )
        return ns, extra


def positive_int(text: str) -> int:
    """argparse type for a size flag (make new-recipe LAYERS= HIDDEN= ..., make nightly ITERS=)."""
    if (n := whole(text)) is None or n < 1:
        t = (text or "").strip()
        if t.isascii() and t.isdigit() and jsonio.integer(t) is None:  # past int64 (the one rule): say so
            raise argparse.ArgumentTypeError(f"{t[:24]}… ({len(t)} digits) is past int64, larger than any size here")
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1")
    return n


def fail(message: str):
    print(f"error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


def flag_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The run options of every entry that builds a run (make plan, submit, sbatch, run-local), spec/runopts.py's."""
    p.add_argument("--run-name", default="", help="checkpoints in <job_dir>/checkpoints/<name>; resume from them")
    p.add_argument("--segments", default="", help="N chained jobs (afterany), each resuming from the last")
    p.add_argument("--nsys", default="", help="<start>:<end>: Nsight Systems on those iterations")
    p.add_argument("--nsys-ranks", default="", help="ranks Nsight profiles (default 0)")
    p.add_argument("--torch-profile", default="", help="<start>:<end>: the PyTorch profiler on those iterations")
    p.add_argument("--torch-profile-ranks", default="", help="ranks the PyTorch profiler profiles (default 0)")
    p.add_argument("--data", default="", help="a data.toml (make prep-data); default: mock data")
    add_gpu_option(p)


def add_gpu_option(p: argparse.ArgumentParser) -> None:
    """GPU=: what memory and throughput are sized for (overlapkit.sizing.hardware: h100, h200)."""
    p.add_argument("--gpu", default="", help="GPU the run executes on: h100 (default) or h200")


# add_run_options' destinations
RUN_OPTIONS = ("run_name", "segments", "nsys", "nsys_ranks", "torch_profile", "torch_profile_ranks", "data")


def request_of(args, *, listing: bool = False, action: str = "plan"):
    """The request (spec/request.py PlanRequest, parsed by bridge/request.py) from an entry's arguments, checked
    before the Bridge import; not yet bound."""
    from overlapkit.bridge import request

    typed = {k: getattr(args, k) for k in RUN_OPTIONS}  # the run options as typed, by runopts.parse's keywords
    return request.parse(args.recipe, args.nodes, args.set, typed, listing=listing, action=action, gpu=args.gpu)
