"""The one retry policy of the model layer: exponential backoff with jitter, bounded twice.

Providers run each request through `call_with_retries`. Only errors marked retryable
(rate limits, server errors, connection failures, per-attempt timeouts) are retried; anything
else surfaces at once. The loop stops at ``max_attempts`` or when the next wait would pass the
call's deadline, whichever comes first, and re-raises the last typed error with ``attempts``
set. Provider SDKs must be configured not to retry on their own (the OpenAI client gets
``max_retries=0``), so a request is never retried by two layers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import ModelError, ModelTimeoutError

__all__ = ["RetryPolicy", "RetryState", "RetryableModelError", "call_with_retries"]

T = TypeVar("T")


class RetryPolicy(BaseModel):
    """How a model call is retried.

    The wait before retry ``n`` (1-based) is ``initial_backoff_s * multiplier**(n-1)``, capped
    at ``max_backoff_s``, then multiplied by a random factor in ``[1 - jitter, 1]`` so clients
    that failed together do not retry together. A ``Retry-After`` from the server replaces the
    computed wait (up to ``max_retry_after_s``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(default=4, ge=1, description="Requests at most, the first included.")
    initial_backoff_s: float = Field(default=0.5, ge=0, description="Wait before the 1st retry.")
    multiplier: float = Field(default=2.0, ge=1, description="Growth of the wait per retry.")
    max_backoff_s: float = Field(default=8.0, ge=0, description="Longest computed wait.")
    jitter: float = Field(
        default=0.5, ge=0, le=1, description="Fraction of each wait that is randomized away."
    )
    max_total_s: float = Field(
        default=120.0,
        gt=0,
        description="Wall-clock budget for a call, retries and waits included, unless the call "
        "sets its own timeout_s.",
    )
    attempt_timeout_s: float = Field(
        default=60.0, gt=0, description="Limit for one request (first byte to last)."
    )
    honor_retry_after: bool = Field(default=True, description="Wait as long as Retry-After says.")
    max_retry_after_s: float = Field(
        default=60.0, ge=0, description="A longer Retry-After ends the retries instead."
    )

    @classmethod
    def none(cls) -> RetryPolicy:
        """One attempt, no retries."""
        return cls(max_attempts=1)

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """The computed wait before retry number ``retry`` (1-based), jitter applied."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        factor = 1.0 - self.jitter * (rng or random).random()
        return base * factor


class RetryableModelError(Exception):
    """Raised by a provider's attempt: ``error`` may be retried after ``retry_after_s``.

    Internal plumbing between a provider and `call_with_retries`; never escapes it.
    """

    def __init__(self, error: ModelError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


@dataclass
class RetryState:
    """What the retry loop knows while a call runs; providers read the deadline from it."""

    policy: RetryPolicy
    deadline: float
    attempts: int = 0
    waits: list[float] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    """The clock ``deadline`` is on (monotonic seconds)."""

    def remaining(self) -> float:
        """Seconds left before the call's deadline."""
        return self.deadline - self.clock()

    def attempt_timeout(self) -> float:
        """The timeout for the next request: the per-attempt limit or what is left, if less."""
        return max(0.001, min(self.policy.attempt_timeout_s, self.remaining()))


async def call_with_retries(
    attempt: Callable[[RetryState], Awaitable[T]],
    policy: RetryPolicy,
    *,
    timeout_s: float | None = None,
    model: str = "",
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> tuple[T, RetryState]:
    """Run ``attempt`` until it succeeds, raises a non-retryable error or the budget ends.

    ``attempt`` raises `RetryableModelError` for a failure that may be retried and any
    [`ModelError`][] for one that may not. ``clock`` and ``sleep`` are the time it runs on
    (tests pass a fake pair, so no bound depends on how busy the machine is).

    Returns:
        The attempt's result and the final state (attempt count, waits).

    Raises:
        ModelError: the last typed error, with ``attempts`` set to the requests made.
    """
    budget = timeout_s if timeout_s is not None else policy.max_total_s
    state = RetryState(policy=policy, deadline=clock() + budget, clock=clock)
    while True:
        state.attempts += 1
        try:
            if state.remaining() <= 0:
                raise ModelTimeoutError(
                    f"no answer within {budget:.3g}s", model=model, attempts=state.attempts
                )
            return await attempt(state), state
        except RetryableModelError as retryable:
            error = retryable.error
            error.attempts = state.attempts
            if state.attempts >= policy.max_attempts:
                raise error from retryable.error.__cause__
            wait = policy.backoff(state.attempts, rng)
            if retryable.retry_after_s is not None and policy.honor_retry_after:
                if retryable.retry_after_s > policy.max_retry_after_s:
                    raise error from retryable.error.__cause__
                wait = retryable.retry_after_s
            if wait >= state.remaining():
                # Waiting would spend the whole budget: give up now, with the real cause.
                raise error from retryable.error.__cause__
            state.waits.append(wait)
            await sleep(wait)
        except ModelError as error:
            error.attempts = state.attempts
            raise
