"""Death-spiral indicators: signs that a session or an agent is degrading.

Over a sliding window of recent model calls, per session and per agent: the retry rate, the
average prompt size and whether it keeps creeping up, state resets, and time to first token.
Crossing a threshold logs a warning (``keel.guards`` logger) and shows in the snapshot, which
the runtime and traces read. A logged warning rather than ``warnings.warn``: these are runtime
conditions of a deployed system, not mistakes in the developer's code. keel installs no
handler: the application's logging configuration decides where warnings go (``keel`` has a
``NullHandler``, so nothing reaches stderr unless the application asks for it).

What a death spiral looks like, and what it does not: every session's prompt grows while its
window fills (each turn adds messages until the context engine starts trimming), so growth
alone is the fill phase, never a warning. A spiral is growth that feeds failures: prompts
growing *while retries climb* (more retries in the newer half of the window than in the older
half: cut-off replies, corrections appended, each retry larger than the last), or, when the
prompt limit is known, prompts pinned near the limit while retries climb.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SpiralMonitor", "SpiralSnapshot", "SpiralThresholds"]

logger = logging.getLogger("keel.guards")


class SpiralThresholds(BaseModel):
    """Where an indicator becomes a warning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window: int = Field(default=20, ge=4, description="Recent model calls each indicator uses.")
    max_retry_rate: float = Field(
        default=0.3, ge=0, le=1, description="Share of calls that were retries (or failed)."
    )
    max_prompt_growth: float = Field(
        default=1.5,
        gt=1,
        description="Average prompt tokens of the newer half over the older half of the window "
        "past which growth counts, when retries climb with it.",
    )
    near_full: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="Share of the prompt limit from which the window counts as full (with a "
        "known limit, prompts this full while retries climb are a spiral).",
    )
    max_state_resets: int = Field(
        default=2, ge=1, description="State reverts/resets within the window's time span."
    )
    max_ttft_ms: float = Field(
        default=10_000, gt=0, description="Average time to the first token, in milliseconds."
    )


class SpiralSnapshot(BaseModel):
    """The indicators for one scope (a session, an agent, or everything), now."""

    model_config = ConfigDict(frozen=True)

    scope: str = Field(description="'session:<id>', 'agent:<name>' or 'all'.")
    calls: int = Field(description="Model calls in the window.")
    retry_rate: float = Field(description="Share of calls in the window that were retries.")
    avg_prompt_tokens: float = Field(description="Average prompt tokens per call.")
    prompt_growth: float = Field(
        description="Average prompt tokens of the newer half over the older half (1.0 = flat)."
    )
    prompt_fill: float | None = Field(
        default=None,
        description="Average prompt of the newer half over the prompt limit; None if unknown.",
    )
    retries_climbing: bool = Field(
        default=False,
        description="More retries in the newer half of the window than in the older half.",
    )
    state_resets: int = Field(description="State resets recorded in the window.")
    avg_ttft_ms: float | None = Field(description="Average time to first token, if measured.")
    warnings: tuple[str, ...] = Field(description="Indicators past their thresholds.")

    @property
    def healthy(self) -> bool:
        """True when no indicator is past its threshold."""
        return not self.warnings


@dataclass
class _Call:
    at: float
    prompt_tokens: int
    retry: bool
    ttft_ms: float | None
    prompt_limit: int | None = None


@dataclass
class _Scope:
    calls: deque[_Call]
    resets: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    warned: frozenset[str] = frozenset()
    retries: int = 0
    """Retries among ``calls``, kept as calls come and go (see `_Scope.add`)."""
    measured: int = 0
    """Calls among ``calls`` with a time to first token, kept like ``retries``."""
    ttft_total: float = 0.0
    """Their times to first token, summed, kept like ``retries``: every model call checks the
    window's average, which then costs no pass over the window."""

    def add(self, call: _Call) -> None:
        """``call`` into the window (the oldest call leaves a full one)."""
        calls = self.calls
        if calls.maxlen is not None and len(calls) == calls.maxlen:
            leaving = calls[0]
            if leaving.retry:
                self.retries -= 1
            if leaving.ttft_ms is not None:
                self.measured -= 1
                # Back to exactly zero with none left: no rounding carried past an empty window.
                self.ttft_total = self.ttft_total - leaving.ttft_ms if self.measured else 0.0
        calls.append(call)
        if call.retry:
            self.retries += 1
        if call.ttft_ms is not None:
            self.measured += 1
            self.ttft_total += call.ttft_ms


class SpiralMonitor:
    """Collects model-call facts and computes death-spiral indicators per session and agent.

    Thread-safe; one monitor is meant to be shared by every run of a process.

    Args:
        thresholds: where each indicator warns.
        prompt_limit: tokens a prompt may take, if known for every call (``record_call`` may
            give it per call instead); it lets a prompt pinned near the limit count.
        max_sessions: how many sessions' windows are kept, the most recently used: a
            long-running process meets sessions without end.
    """

    def __init__(
        self,
        thresholds: SpiralThresholds | None = None,
        *,
        prompt_limit: int | None = None,
        max_sessions: int = 4096,
    ) -> None:
        self.thresholds = thresholds or SpiralThresholds()
        self.prompt_limit = prompt_limit
        self.max_sessions = max_sessions
        self._scopes: dict[str, _Scope] = {}
        # A process meets sessions without end: the windows kept are the most recently used
        # sessions' (a session quiet that long has no spiral under way to watch).
        self._sessions: OrderedDict[str, _Scope] = OrderedDict()
        self._lock = threading.Lock()

    def _scope(self, name: str) -> _Scope:
        kept = self._sessions if name.startswith("session:") else self._scopes
        scope = kept.get(name)
        if scope is None:
            scope = _Scope(calls=deque(maxlen=self.thresholds.window))
            kept[name] = scope
            if kept is self._sessions and len(kept) > self.max_sessions:
                self._sessions.popitem(last=False)
        elif kept is self._sessions:
            self._sessions.move_to_end(name)
        return scope

    @staticmethod
    def _names(session_id: str | None, agent: str | None) -> list[str]:
        names = ["all"]
        if session_id is not None:
            names.append(f"session:{session_id}")
        if agent is not None:
            names.append(f"agent:{agent}")
        return names

    def record_call(
        self,
        *,
        session_id: str | None = None,
        agent: str | None = None,
        prompt_tokens: int = 0,
        retry: bool = False,
        ttft_ms: float | None = None,
        prompt_limit: int | None = None,
    ) -> list[SpiralSnapshot]:
        """Record one model call; returns the snapshots that newly crossed a threshold.

        ``prompt_limit`` is the most tokens this call's prompt could take (the window minus
        the answer reserve), if known; it defaults to the monitor's.
        """
        limit = prompt_limit if prompt_limit is not None else self.prompt_limit
        call = _Call(time.monotonic(), prompt_tokens, retry, ttft_ms, limit)
        names = self._names(session_id, agent)
        with self._lock:
            for name in names:
                self._scope(name).add(call)
        return self._evaluate(session_id, agent, names)

    def record_state_reset(
        self, *, session_id: str | None = None, agent: str | None = None
    ) -> list[SpiralSnapshot]:
        """Record that state was reverted or reset; returns newly crossed snapshots."""
        now = time.monotonic()
        with self._lock:
            for name in self._names(session_id, agent):
                self._scope(name).resets.append(now)
        return self._evaluate(session_id, agent)

    def snapshot(
        self, *, session_id: str | None = None, agent: str | None = None
    ) -> SpiralSnapshot:
        """The indicators for a session, an agent, or (neither given) the whole process."""
        if session_id is not None:
            name = f"session:{session_id}"
        elif agent is not None:
            name = f"agent:{agent}"
        else:
            name = "all"
        with self._lock:
            return self._compute(name, self._scope(name))[0]()

    def _evaluate(
        self, session_id: str | None, agent: str | None, names: list[str] | None = None
    ) -> list[SpiralSnapshot]:
        crossed: list[SpiralSnapshot] = []
        with self._lock:
            for name in (names or self._names(session_id, agent))[1:] or ["all"]:
                scope = self._scope(name)
                # Keyed by indicator, not by its text: a retry rate moving from 50% to 56% is
                # the same crossing, logged once.
                quiet = self._quiet_keys(scope)
                snapshot, keys = self._compute(name, scope) if quiet is None else (None, quiet)
                new = keys - scope.warned
                scope.warned = keys
                if new and snapshot is not None:
                    crossed.append(snapshot())
        for snap in crossed:
            logger.warning(
                "death-spiral indicators for %s: %s", snap.scope, "; ".join(snap.warnings)
            )
        return crossed

    def _quiet_keys(self, scope: _Scope) -> frozenset[str] | None:
        """The indicators past their thresholds, found without `_compute` when the window has
        no retry and no reset (nearly every model call): then only the time to first token
        can warn. None: compute them all."""
        calls = scope.calls
        if scope.retries or not calls:
            return None
        if scope.resets and scope.resets[-1] >= calls[0].at:
            return None  # a reset within the window's time span
        # The kept sum may be off by rounding: one near the threshold is computed exactly.
        limit = self.thresholds.max_ttft_ms * scope.measured * (1 - 1e-9)
        if scope.measured and scope.ttft_total > limit:
            return None
        return frozenset()

    def _compute(
        self, name: str, scope: _Scope
    ) -> tuple[Callable[[], SpiralSnapshot], frozenset[str]]:
        """The indicators' warnings, and what makes their snapshot: made only when asked for
        (a model call that crosses no new threshold, nearly every one, makes none)."""
        limits = self.thresholds
        calls = list(scope.calls)
        count = len(calls)
        retries = [call.retry for call in calls]
        retry_rate = sum(retries) / count if count else 0.0
        prompts = [call.prompt_tokens for call in calls]
        avg_prompt = sum(prompts) / count if count else 0.0
        growth = 1.0
        fill: float | None = None
        climbing = False
        # Growth and retry rate need enough calls to mean anything; a single run's first steps
        # naturally grow the prompt.
        enough = count >= max(8, limits.window // 2)
        if enough:
            half = count // 2
            older = sum(prompts[:half]) / half
            newer = sum(prompts[-half:]) / half
            growth = newer / older if older > 0 else 1.0
            climbing = sum(retries[-half:]) > sum(retries[:half])
            known = [c.prompt_limit for c in calls[-half:] if c.prompt_limit]
            if known:
                fill = newer / (sum(known) / len(known))
        since = calls[0].at if calls else time.monotonic()
        resets = sum(1 for at in scope.resets if at >= since) if calls else len(scope.resets)
        ttfts = [call.ttft_ms for call in calls if call.ttft_ms is not None]
        avg_ttft = sum(ttfts) / len(ttfts) if ttfts else None
        warnings: dict[str, str] = {}  # indicator -> its line
        if enough and retry_rate > limits.max_retry_rate:
            warnings["retries"] = f"retry rate {retry_rate:.0%} > {limits.max_retry_rate:.0%}"
        # The window filling is not a spiral (module docstring): growth counts only together
        # with climbing retries, and so does a prompt pinned near its limit.
        if climbing and growth > limits.max_prompt_growth:
            warnings["prompt"] = (
                f"prompt tokens growing x{growth:.2f} > x{limits.max_prompt_growth:g} "
                "while retries climb"
            )
        elif climbing and fill is not None and fill >= limits.near_full:
            warnings["prompt"] = (
                f"prompts at {fill:.0%} of their limit (>= {limits.near_full:.0%}) "
                "while retries climb"
            )
        if resets > limits.max_state_resets:
            warnings["resets"] = f"{resets} state resets > {limits.max_state_resets}"
        if avg_ttft is not None and avg_ttft > limits.max_ttft_ms:
            warnings["ttft"] = f"time to first token {avg_ttft:.0f} ms > {limits.max_ttft_ms:g} ms"
        snapshot = functools.partial(
            SpiralSnapshot,
            scope=name,
            calls=count,
            retry_rate=retry_rate,
            avg_prompt_tokens=avg_prompt,
            prompt_growth=growth,
            prompt_fill=fill,
            retries_climbing=climbing,
            state_resets=resets,
            avg_ttft_ms=avg_ttft,
            warnings=tuple(warnings.values()),
        )
        return snapshot, frozenset(warnings)
