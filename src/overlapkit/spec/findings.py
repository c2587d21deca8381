"""What a plan's audit says: one type for every stage that finds something (the overlap audit, the launch
environment, the stack's start, the run options, the memory estimate). plan.json's audit lists them by level."""

from __future__ import annotations

from typing import NamedTuple


# A tuple, so a producer's (level, code, message[, fix]) is one as it stands: Finding(*row).
class Finding(NamedTuple):
    level: str  # "error" (the job would fail, or run without an overlap it claims) | "warning"
    code: str  # stable: the nightly and the tests read it
    message: str  # one line that names the fix
    fix: str | None = None  # a SET= that clears it, where one exists (tests apply each and re-audit)
