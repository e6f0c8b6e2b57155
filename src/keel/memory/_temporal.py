"""Dates and relative times named in a query, as time ranges a memory's time can fall in.

"What did Maria donate in December 2023?", "Who did she meet on May 3, 2023?", "What happened
last week?": a memory whose time (its event time, else when it was stored) falls in the range
the question names is more likely its answer. The retriever multiplies such a candidate's
fused score by ``1 + temporal_weight`` (see [`RetrievalConfig`][keel.memory.RetrievalConfig]).

Ranges are wider than the named period on one side only: a month or a day is talked about
in the days after it ("last week I ...") but not before it happened, so each range runs
``_REPORTED_AFTER`` past its end. That slack is a property of how people report events, fixed
here and not tuned on any benchmark.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["TimeRange", "time_ranges"]

_MONTHS = {name.lower(): number for number, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): number for number, name in enumerate(calendar.month_abbr) if name})
_MONTHS["sept"] = 9

_REPORTED_AFTER = timedelta(days=7)
"""How long after a named period a memory of it is still counted as in it."""

_MONTH = "(" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + ")"
_DAY_MONTH_YEAR = re.compile(
    rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH}\.?,?\s+(\d{{4}})\b"
)
_MONTH_DAY_YEAR = re.compile(rf"\b{_MONTH}\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}})\b")
_MONTH_YEAR = re.compile(rf"\b{_MONTH}\.?,?\s+(\d{{4}})\b")
_MONTH_ALONE = re.compile(rf"\b(?:in|during|of|since|by|early|late|mid)\s+{_MONTH}\b")
_YEAR = re.compile(r"\b(?:in|during|of|since)\s+((?:19|20)\d{2})\b")
_AGO = re.compile(
    r"\b(a|an|one|two|three|four|five|six|seven|eight|nine|ten|\d{1,2})\s+"
    r"(day|week|month|year)s?\s+ago\b"
)
_LAST = re.compile(r"\b(?:last|past|previous)\s+(week|weekend|month|year)\b")
_NUMBERS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5,
    "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
}  # fmt: skip
_UNIT_DAYS = {"day": 1, "week": 7, "weekend": 7, "month": 30, "year": 365}


@dataclass(frozen=True)
class TimeRange:
    """``start <= time < end``; ``month`` set (and start/end unused) for a month of any year."""

    start: datetime
    end: datetime
    month: int | None = None

    def contains(self, when: datetime) -> bool:
        """Whether ``when`` (aware or naive UTC) falls in the range."""
        when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
        if self.month is not None:
            first = datetime(when.year, self.month, 1, tzinfo=UTC)
            last = _month_end(first)
            if first <= when < last + _REPORTED_AFTER:
                return True
            # Early January still reports on the December before it.
            previous = datetime(when.year - 1, self.month, 1, tzinfo=UTC)
            return previous <= when < _month_end(previous) + _REPORTED_AFTER
        return self.start <= when < self.end


def _month_end(first: datetime) -> datetime:
    return (first + timedelta(days=32)).replace(day=1)


def _day(year: int, month: int, day: int) -> TimeRange | None:
    try:
        start = datetime(year, month, day, tzinfo=UTC)
    except ValueError:
        return None
    # A day, give or take one for time zones, and the week after it.
    return TimeRange(start - timedelta(days=1), start + timedelta(days=1) + _REPORTED_AFTER)


def time_ranges(text: str, now: datetime) -> list[TimeRange]:
    """The time ranges ``text`` names: absolute dates (a day, a month of a year, a month, a
    year) and times relative to ``now`` ("yesterday", "last week", "three months ago").

    Empty when it names none: most queries do not, and then nothing is boosted.
    """
    lowered = text.lower()
    ranges: list[TimeRange] = []
    spans: list[tuple[int, int]] = []

    def free(match: re.Match[str]) -> bool:
        return all(match.end() <= a or match.start() >= b for a, b in spans)

    for match in _DAY_MONTH_YEAR.finditer(lowered):
        found = _day(int(match.group(3)), _MONTHS[match.group(2)], int(match.group(1)))
        if found is not None:
            ranges.append(found)
            spans.append(match.span())
    for match in _MONTH_DAY_YEAR.finditer(lowered):
        if not free(match):
            continue
        found = _day(int(match.group(3)), _MONTHS[match.group(1)], int(match.group(2)))
        if found is not None:
            ranges.append(found)
            spans.append(match.span())
    for match in _MONTH_YEAR.finditer(lowered):
        if not free(match):
            continue
        first = datetime(int(match.group(2)), _MONTHS[match.group(1)], 1, tzinfo=UTC)
        ranges.append(TimeRange(first, _month_end(first) + _REPORTED_AFTER))
        spans.append(match.span())
    for match in _MONTH_ALONE.finditer(lowered):
        if free(match):
            epoch = datetime(1970, 1, 1, tzinfo=UTC)
            ranges.append(TimeRange(epoch, epoch, month=_MONTHS[match.group(1)]))
            spans.append(match.span())
    for match in _YEAR.finditer(lowered):
        if free(match):
            first = datetime(int(match.group(1)), 1, 1, tzinfo=UTC)
            ranges.append(TimeRange(first, first.replace(year=first.year + 1) + _REPORTED_AFTER))
    now = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    if re.search(r"\byesterday\b", lowered):
        ranges.append(TimeRange(now - timedelta(days=2), now))
    for match in _AGO.finditer(lowered):
        count = _NUMBERS.get(match.group(1)) or int(match.group(1))
        days = count * _UNIT_DAYS[match.group(2)]
        # "Three months ago" is approximate: a quarter of the span either side.
        slack = timedelta(days=max(2, days // 4))
        ranges.append(
            TimeRange(now - timedelta(days=days) - slack, now - timedelta(days=days) + slack)
        )
    for match in _LAST.finditer(lowered):
        days = _UNIT_DAYS[match.group(1)]
        ranges.append(TimeRange(now - timedelta(days=2 * days), now))
    return ranges
