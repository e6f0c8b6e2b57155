"""Parsing the time filters of trace queries: ISO timestamps or relative ages like ``2d``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from keel.errors import UsageError

__all__ = ["parse_since"]

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d|day|days|w|wk|weeks?)\s*$")
_UNITS = {
    "s": "seconds",
    "sec": "seconds",
    "m": "minutes",
    "min": "minutes",
    "h": "hours",
    "hr": "hours",
    "d": "days",
    "day": "days",
    "days": "days",
    "w": "weeks",
    "wk": "weeks",
    "week": "weeks",
    "weeks": "weeks",
}


def parse_since(value: str, *, now: datetime | None = None) -> datetime:
    """The UTC instant ``value`` names: ``"30m"``, ``"1h"``, ``"2d"``, ``"1w"`` ago, or an ISO
    timestamp (``2026-11-30``, ``2026-11-30T04:00``, ``...Z``, with or without an offset;
    without one it is taken as UTC).

    Raises:
        UsageError: ``value`` is neither form.
    """
    match = _RELATIVE.match(value.lower())
    if match:
        amount = float(match.group(1))
        unit = _UNITS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(**{unit: amount})
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UsageError(
            f"cannot read time {value!r}: use an ISO timestamp (2026-11-30T04:00Z) "
            "or an age such as 30m, 1h, 2d, 1w"
        ) from exc
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)
