from __future__ import annotations

import random

import pytest

from keel.errors import BadRequestError, ModelUnavailableError, RateLimitError
from keel.models import RetryPolicy
from keel.models._retry import RetryableModelError, RetryState, call_with_retries


def test_backoff_grows_exponentially_is_capped_and_jittered() -> None:
    policy = RetryPolicy(initial_backoff_s=1, multiplier=2, max_backoff_s=5, jitter=0.5)
    rng = random.Random(7)
    waits = [[policy.backoff(retry, rng) for _ in range(200)] for retry in (1, 2, 3, 4)]
    for retry, samples in zip((1, 2, 3, 4), waits, strict=True):
        base = min(5, 2 ** (retry - 1))
        assert all(base * 0.5 <= wait <= base for wait in samples)
        assert max(samples) - min(samples) > base * 0.3  # really randomized
    assert RetryPolicy(jitter=0).backoff(3) == 2.0


async def test_retries_then_succeeds_and_counts_attempts() -> None:
    seen: list[int] = []

    async def attempt(state: RetryState) -> str:
        seen.append(state.attempts)
        if state.attempts < 3:
            raise RetryableModelError(ModelUnavailableError("503"))
        return "ok"

    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, jitter=0)
    result, state = await call_with_retries(attempt, policy)
    assert result == "ok"
    assert seen == [1, 2, 3]
    assert state.attempts == 3
    assert state.waits == [0.01, 0.02]


async def test_gives_up_after_max_attempts_with_typed_error() -> None:
    async def attempt(state: RetryState) -> str:
        raise RetryableModelError(RateLimitError("429"), retry_after_s=0.01)

    with pytest.raises(RateLimitError) as caught:
        await call_with_retries(attempt, RetryPolicy(max_attempts=4, initial_backoff_s=0))
    assert caught.value.attempts == 4


async def test_non_retryable_error_surfaces_at_once() -> None:
    calls = 0

    async def attempt(state: RetryState) -> str:
        nonlocal calls
        calls += 1
        raise BadRequestError("400")

    with pytest.raises(BadRequestError) as caught:
        await call_with_retries(attempt, RetryPolicy(max_attempts=5))
    assert calls == 1 and caught.value.attempts == 1


class _FakeTime:
    """A clock that moves only when the retry loop sleeps: bounds are exact, never flaky."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_retry_after_replaces_backoff_and_long_ones_end_retries() -> None:
    async def short(state: RetryState) -> str:
        if state.attempts == 1:
            raise RetryableModelError(RateLimitError("429"), retry_after_s=0.15)
        return "ok"

    policy = RetryPolicy(initial_backoff_s=5, max_retry_after_s=1)
    fake = _FakeTime()
    _, state = await call_with_retries(short, policy, clock=fake.clock, sleep=fake.sleep)
    assert state.waits == [0.15] and fake.slept == [0.15]  # the server's wait, not 5 s

    async def long(state: RetryState) -> str:
        raise RetryableModelError(RateLimitError("429"), retry_after_s=30)

    fake = _FakeTime()
    with pytest.raises(RateLimitError) as caught:
        await call_with_retries(long, policy, clock=fake.clock, sleep=fake.sleep)
    assert caught.value.attempts == 1
    assert fake.slept == []  # a Retry-After past the cap ends the retries without waiting


async def test_total_time_budget_stops_retries_before_waiting_past_it() -> None:
    async def attempt(state: RetryState) -> str:
        raise RetryableModelError(ModelUnavailableError("down"))

    policy = RetryPolicy(max_attempts=100, initial_backoff_s=0.1, jitter=0, max_backoff_s=0.1)
    fake = _FakeTime()
    started = fake.now
    with pytest.raises(ModelUnavailableError) as caught:
        await call_with_retries(attempt, policy, timeout_s=0.35, clock=fake.clock, sleep=fake.sleep)
    # Attempts at 0, 0.1, 0.2 and 0.3 s; a fourth wait would end past the 0.35 s budget.
    assert caught.value.attempts == 4
    assert fake.now - started == pytest.approx(0.3)


async def test_attempt_timeout_never_exceeds_what_is_left() -> None:
    budgets: list[float] = []
    fake = _FakeTime()

    async def attempt(state: RetryState) -> str:
        budgets.append(state.attempt_timeout())
        fake.now += 0.5  # the attempt itself took half a second
        budgets.append(state.attempt_timeout())
        return "ok"

    await call_with_retries(
        attempt, RetryPolicy(attempt_timeout_s=60), timeout_s=2, clock=fake.clock, sleep=fake.sleep
    )
    assert budgets == [2.0, 1.5]


async def test_the_real_clock_is_the_default() -> None:
    async def attempt(state: RetryState) -> float:
        return state.remaining()

    remaining, _ = await call_with_retries(attempt, RetryPolicy(), timeout_s=30)
    assert 0 < remaining <= 30
