"""The spiral monitor's quiet windows: a model call whose windows hold no retry and no reset
(nearly every call) is judged without computing the indicators, and judged the same."""

from __future__ import annotations

import random
from typing import Any

from keel.guards import SpiralMonitor, SpiralThresholds


class _Computing(SpiralMonitor):
    """The monitor computing every indicator on every call, as it did before."""

    def _quiet_keys(self, scope: Any) -> frozenset[str] | None:
        return None


def test_quiet_calls_compute_no_window() -> None:
    monitor = SpiralMonitor()
    computed = [0]
    compute = monitor._compute

    def counting(name: str, scope: Any) -> Any:
        computed[0] += 1
        return compute(name, scope)

    monitor._compute = counting  # type: ignore[method-assign]
    for _ in range(100):
        assert monitor.record_call(session_id="s", agent="a", prompt_tokens=500, ttft_ms=20) == []
    assert computed[0] == 0
    # A retry: its windows are computed (and those of the calls while it is in them).
    monitor.record_call(session_id="s", agent="a", prompt_tokens=500, retry=True)
    assert computed[0] == 2
    window = monitor.thresholds.window
    for _ in range(window - 1):
        monitor.record_call(session_id="s", agent="a", prompt_tokens=500)
    assert computed[0] == 2 * window
    # The retry has left the windows: quiet again.
    for _ in range(10):
        monitor.record_call(session_id="s", agent="a", prompt_tokens=500)
    assert computed[0] == 2 * window


def test_quiet_windows_warn_exactly_as_computed_ones() -> None:
    """Random traffic (seeded): retries coming and leaving the window, resets, slow first
    tokens, two sessions sharing an agent. Every call's crossings, and what each scope has
    warned of, are those of the monitor that computes everything."""
    thresholds = SpiralThresholds(window=8, max_state_resets=1, max_ttft_ms=400)
    quick, computing = SpiralMonitor(thresholds), _Computing(thresholds)
    draw = random.Random(46)
    for _ in range(3000):
        session = draw.choice(("s1", "s2"))
        if draw.random() < 0.02:
            for monitor in (quick, computing):
                monitor.record_state_reset(session_id=session, agent="a")
            continue
        call: dict[str, Any] = {
            "session_id": session,
            "agent": "a",
            "prompt_tokens": draw.randrange(100, 4000),
            "retry": draw.random() < 0.05,
            "ttft_ms": draw.choice((None, draw.uniform(10, 900))),
        }
        assert quick.record_call(**call) == computing.record_call(**call)
        for name in ("session:s1", "session:s2", "agent:a"):
            assert quick._scope(name).warned == computing._scope(name).warned


def test_slow_first_tokens_that_left_the_window_compute_nothing_more() -> None:
    """The window's time to first token is kept as calls come and go: once the slow ones have
    left, a quiet call computes no window again (nor warns)."""
    monitor = SpiralMonitor(SpiralThresholds(window=4, max_ttft_ms=400))
    computed = [0]
    compute = monitor._compute

    def counting(name: str, scope: Any) -> Any:
        computed[0] += 1
        return compute(name, scope)

    monitor._compute = counting  # type: ignore[method-assign]
    crossed = [monitor.record_call(session_id="s", prompt_tokens=500, ttft_ms=900.5)]
    crossed += [monitor.record_call(session_id="s", prompt_tokens=500, ttft_ms=900.5)]
    assert [[snapshot.scope for snapshot in new] for new in crossed] == [["session:s"], []]
    for _ in range(4):  # the slow calls leave the window of four
        monitor.record_call(session_id="s", prompt_tokens=500, ttft_ms=20.25)
    before = computed[0]
    for _ in range(10):
        assert monitor.record_call(session_id="s", prompt_tokens=500, ttft_ms=20.25) == []
    assert computed[0] == before
    assert monitor.snapshot(session_id="s").avg_ttft_ms == 20.25
