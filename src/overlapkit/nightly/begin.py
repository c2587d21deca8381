"""AT= of `make nightly-schedule`: the subset of `sbatch --begin` we accept, and the begin times it gives.

Times are the local wall clock of the machine that runs sbatch, as sbatch itself reads --begin and squeue prints it.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from overlapkit.errors import BadInput

# --- the subset of sbatch --begin we accept --------------------------------------------------------------------
# Slurm's parse_time() (src/common/parse_time.c, quoted by sbatch(1) under --begin) takes HH:MM[:SS] with an optional
# AM/PM, the named times below, now+count[seconds(default)|minutes|hours|days|weeks] (whole unit names, singular or
# plural), and YYYY-MM-DD[THH:MM[:SS]]. Left out on purpose: now-N and past dates (a nightly cannot start in the
# past), MMDD[YY] and MM/DD[/YY] (read differently by different people), today/tomorrow (a date, not a time of day).
NAMED = {"midnight": 0, "elevenses": 11, "noon": 12, "fika": 15, "teatime": 16}
UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
FORMS = (
    "HH:MM[:SS] (02:00, 2:30PM), midnight|noon|elevenses|fika|teatime, now+N[seconds|minutes|hours|days|weeks] "
    "(now+90 is 90 seconds, now+2hours), or YYYY-MM-DD[THH:MM[:SS]] (2026-12-02T02:00)"
)
# Our bound, not Slurm's: a first night more than a year ahead is a typo (and now+99999999999weeks is past what a
# datetime holds, year 9999). A year and a day, so "the same date next year" is still accepted.
MAX_AHEAD = dt.timedelta(days=366)
_CLOCK = re.compile(r"(?P<h>\d{1,2}):(?P<m>\d{2})(?::(?P<s>\d{2}))?\s*(?P<half>[ap]m)?", re.IGNORECASE)
_NOW = re.compile(r"now\+(?P<n>\d+)(?P<unit>[a-z]*)", re.IGNORECASE)
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?")
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S"  # what --begin takes and squeue's EligibleTime prints


class ScheduleError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class At:
    """A parsed AT: a time of day (daily from the soonest one), an offset from now, or a date and time."""

    text: str
    clock: tuple[int, int, int] | None = None
    offset_s: int | None = None
    when: dt.datetime | None = None


def _bad_at(text: str) -> ScheduleError:
    return ScheduleError(f"AT={text!r} is not a start time; use {FORMS}")


def _too_far(text: str) -> ScheduleError:
    days, shown = MAX_AHEAD.days, text if len(text) <= 60 else text[:40] + "…"
    return ScheduleError(
        f"AT={shown!r} is more than {days} days ahead: the first night starts within {days} days "
        f"(at most now+{int(MAX_AHEAD.total_seconds())}, i.e. now+{days}days, or a date before then)"
    )


def parse_at(text: str) -> At:
    """AT as make takes it → At; anything else is one ScheduleError naming the accepted forms."""
    t = (text or "").strip()
    if not t:
        raise ScheduleError(f"AT='': give the time the nightly starts every day; use {FORMS}")
    if t.lower() in NAMED:
        return At(t, clock=(NAMED[t.lower()], 0, 0))
    if m := _CLOCK.fullmatch(t):
        h, minute, s = int(m["h"]), int(m["m"]), int(m["s"] or 0)
        half = (m["half"] or "").lower()
        if half and not 1 <= h <= 12 or h > 23 or minute > 59 or s > 59:  # parse_time.c _get_time's ranges
            raise _bad_at(t)
        if half == "am":
            h %= 12  # 12:30AM is 00:30
        elif half == "pm":
            h = h % 12 + 12  # 12:30PM is 12:30
        return At(t, clock=(h, minute, s))
    if m := _NOW.fullmatch(t):
        unit = m["unit"].lower().removesuffix("s")
        if m["unit"] and unit not in UNITS:
            raise _bad_at(t)
        # a count of more than 12 digits is past the bound in any unit (and int() refuses 4300 digits)
        if len(m["n"].lstrip("0")) > 12 or int(m["n"]) * UNITS.get(unit, 1) > MAX_AHEAD.total_seconds():
            raise _too_far(t)
        return At(t, offset_s=int(m["n"]) * UNITS.get(unit, 1))
    if _ISO.fullmatch(t):
        try:
            return At(t, when=dt.datetime.fromisoformat(t))
        except ValueError:
            raise _bad_at(t) from None
    raise _bad_at(t)


def check_at(text: str) -> At:
    """parse_at, and a date and time must still be ahead."""
    at = parse_at(text)
    first_begin(at, local_now())
    return at


def first_begin(at: At, now: dt.datetime) -> dt.datetime:
    """When the first night starts. A time of day is today if it is still ahead (to the minute, as parse_time.c
    decides), else tomorrow; a date and time must be in the future."""
    now = now.replace(microsecond=0)
    if at.offset_s is not None:
        return now + dt.timedelta(seconds=at.offset_s)
    if at.when is not None:
        if at.when <= now:
            raise ScheduleError(
                f"AT={at.text!r} is in the past (now {iso(now)}): give a later date and time, or a "
                "time of day such as 02:00"
            )
        if at.when - now > MAX_AHEAD:
            raise _too_far(at.text)
        return at.when
    h, m, s = at.clock
    today = now.replace(hour=h, minute=m, second=s)
    return today if (h, m) > (now.hour, now.minute) else today + dt.timedelta(days=1)


def next_begin(prev: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The successor's begin: the same wall-clock time the next day (so now+N repeats 24 h after the first night;
    across a DST change the time of day is kept). A scheduler that started more than a day late skips the nights
    already past rather than queueing them all at once."""
    begin = prev + dt.timedelta(days=1)
    while begin <= now:
        begin += dt.timedelta(days=1)
    return begin


def iso(t: dt.datetime) -> str:
    return t.strftime(_ISO_FORMAT)


def parse_iso(text: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None  # squeue prints N/A or Unknown for a time it does not know


def local_now() -> dt.datetime:
    return dt.datetime.now().replace(microsecond=0)
