from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from keel.errors import UsageError
from keel.tracing import parse_since

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "delta"),
    [
        ("30s", timedelta(seconds=30)),
        ("15m", timedelta(minutes=15)),
        ("1h", timedelta(hours=1)),
        ("2d", timedelta(days=2)),
        ("1w", timedelta(weeks=1)),
        ("1.5h", timedelta(minutes=90)),
        (" 3 days ", timedelta(days=3)),
    ],
)
def test_relative_ages(text: str, delta: timedelta) -> None:
    assert parse_since(text, now=NOW) == NOW - delta


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-30", datetime(2026, 11, 30, tzinfo=UTC)),
        ("2026-11-30T04:00", datetime(2026, 11, 30, 4, tzinfo=UTC)),
        ("2026-11-30T04:00Z", datetime(2026, 11, 30, 4, tzinfo=UTC)),
        ("2026-11-30T06:00+02:00", datetime(2026, 11, 30, 4, tzinfo=UTC)),
    ],
)
def test_iso_timestamps(text: str, expected: datetime) -> None:
    parsed = parse_since(text)
    assert parsed == expected and parsed.tzinfo == UTC


def test_nonsense_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cannot read time"):
        parse_since("last tuesday")
