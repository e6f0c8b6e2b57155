"""The rate limiter's window, in this process and in Redis: the same counts either way."""

from __future__ import annotations

import pytest

from keel.service import RateLimiter


@pytest.mark.parametrize("shared", [False, True])
async def test_a_window_allows_its_limit_then_says_how_long_to_wait(
    shared: bool, request: pytest.FixtureRequest
) -> None:
    now = [600.0]
    redis_url = request.getfixturevalue("redis_url") if shared else None
    limiter = RateLimiter(2, redis_url=redis_url, clock=lambda: now[0])
    key = f"key-{shared}"
    assert [await limiter.check(key) for _ in range(2)] == [None, None]
    now[0] = 615.0
    assert await limiter.check(key) == 45.0
    assert await limiter.check("another key") is None
    now[0] = 660.0  # the next minute
    assert await limiter.check(key) is None
    await limiter.aclose()
