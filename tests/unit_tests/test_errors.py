"""The project's error classes and the one-line rule: BadInput is a ValueError (checks that predate it still hold)
and a file problem is bad input; one_line shows a newline or a terminal escape a value carried into a message
escaped, so an error is the one line it says it is, and plain text (spaces, non-ASCII letters) unchanged."""

from __future__ import annotations

from overlapkit import jsonio
from overlapkit.errors import BadInput, ClusterFailure, one_line


def test_the_classes_decide_the_exit_status_by_kind():
    assert issubclass(BadInput, ValueError) and issubclass(ClusterFailure, RuntimeError)
    assert issubclass(jsonio.FileProblem, BadInput)


def test_one_line_escapes_what_a_terminal_would_act_on():
    assert one_line("GPU=a\nb\x1b[2J\x07\r\t c") == "GPU=a\\nb\\x1b[2J\\x07\\r\\t c"
    assert one_line("recipe\u202eevil") == "recipe\\u202eevil"  # a bidirectional override: not printable
    assert one_line("≤ 2,016 — Llama3 é") == "≤ 2,016 — Llama3 é"
