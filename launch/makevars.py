"""The answer to a command-line variable the Makefile does not know (`make plan RECIPIE=...`): make would ignore it
and plan the default recipe, so the Makefile asks this module at parse time (`python -m launch make-vars`) and stops
with its one line, naming the nearest known variable (difflib), exit 2.

Known: the Makefile's data variables (DATA_VARS) and its plumbing (UV, PY), both handed over by the Makefile; the
environment variables this project reads (OVERLAPKIT_*, RECIPES_PATH), which make puts into the command's
environment when given on its command line; and GNU make's own variables (`make -p -f /dev/null` lists them, plus
the special ones of the GNU make manual, "Special Variables" and "Variables Used by Implicit Rules"). A variable set
in the environment is never checked: only what is typed after `make` is.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess

from launch.args import Parser
from overlapkit.errors import one_line

PROJECT_ENV = ("OVERLAPKIT_",)  # the prefix of this project's environment variables
PROJECT_ENV_NAMES = ("RECIPES_PATH",)  # overlapkit.bridge.registry.PATH_VAR
# GNU make 4.3 manual, "Special Variables" and "Other Special Variables", not all printed by `make -p`
MAKE_SPECIAL = ("VPATH", "GNUMAKEFLAGS", "MAKESHELL", "MAKELEVEL", "MAKEOVERRIDES", "MAKE_RESTARTS", "MFLAGS")
MAKE_SPECIAL += ("MAKE_TERMOUT", "MAKE_TERMERR", ".EXTRA_PREREQS", "SUFFIXES")


def make_own() -> set[str]:
    """The variables GNU make itself defines (its defaults, automatic and special ones), from make's own database."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}  # no variable of ours in its answer
    database = ["make", "-p", "-f", "/dev/null"]
    try:
        out = subprocess.run(database, env=env, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    names = re.findall(r"^# (?:default|automatic|makefile|'override' directive)\n([^\s:?+!]+) [:?+!]?=", out, re.M)
    return {*names, *MAKE_SPECIAL}


def answer(given: list[str], known: list[str]) -> str:
    """One line for the unknown names among `given`, each with the nearest of `known`; "" when all are known."""
    unknown = [n for n in given if n not in known and not n.startswith(PROJECT_ENV) and n not in PROJECT_ENV_NAMES]
    if unknown:
        unknown = [name for name in unknown if name not in make_own()]
    if not unknown:
        return ""
    nearest = [(name, difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)) for name in unknown]
    parts = [f"{name}= (did you mean {close[0]}=?)" if close else f"{name}=" for name, close in nearest]
    what = "is not a variable of this Makefile (make would ignore it)" if len(unknown) == 1 else "are not variables"
    what += "" if len(unknown) == 1 else " of this Makefile (make would ignore them)"
    fix = "fix the name, or set an environment variable before make: NAME=value make <target>"
    return one_line(f"{', '.join(parts)} {what}: {fix}")


def parse(argv):
    p = Parser(prog="make (its variables)", description="answer the command line's variables the Makefile lacks")
    p.add_argument("--known", default="", help="the Makefile's own variables, space-separated")
    p.add_argument("--given", default="", help="the command line's variables not among them")
    return p.parse_args(argv)


def check(args) -> bool:
    return False


def run(args) -> int:
    print(answer(args.given.split(), args.known.split()) or "ok")  # "ok": make goes on; anything else, it stops
    return 0
