"""The project's own error classes, which decide a command's exit status (launch/commands.py catches these and
nothing wider).

- `BadInput`: what the user typed or pointed us at is wrong (a recipe name, SET=, a file we read). One line on
  stderr naming the fix, exit 2, no traceback.
- `AuditFailed`: the request was good and the command ran, but what it built fails its audit (nothing submitted,
  no recipe written). One line, exit 1: the same status as a plan whose audit has errors.
- `ClusterFailure`: the cluster's own tool (sbatch, scancel, squeue, ...) refused or failed. Its message is the
  cluster's, with our one line of context; exit 3.

Anything else that escapes a command is a bug and shows its traceback.
"""

from __future__ import annotations


class BadInput(ValueError):
    """Bad input: one line naming the fix, exit 2. A ValueError so the checks that predate this class still hold."""


class AuditFailed(Exception):
    """The built plan or recipe fails its audit: one line, exit 1."""


class ClusterFailure(RuntimeError):
    """The cluster's tool failed: its own message, exit 3."""


def one_line(message: str) -> str:
    """`message` as one printable line: a control character a value carried into it (a newline, a terminal escape)
    is shown escaped (\\n, \\x1b), never acted on by the terminal."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in message)
