"""Death-spiral indicators per session and per agent, with thresholds."""

from __future__ import annotations

import logging

import pytest

from keel.guards import SpiralMonitor, SpiralThresholds


def test_healthy_traffic_raises_nothing() -> None:
    monitor = SpiralMonitor()
    for _ in range(20):
        assert monitor.record_call(session_id="s", agent="a", prompt_tokens=500, ttft_ms=200) == []
    snapshot = monitor.snapshot(session_id="s")
    assert snapshot.healthy and snapshot.calls == 20
    assert snapshot.avg_prompt_tokens == 500 and snapshot.prompt_growth == 1.0
    assert snapshot.avg_ttft_ms == 200 and snapshot.retry_rate == 0


def test_creeping_prompts_and_retries_warn_once_per_crossing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monitor = SpiralMonitor(SpiralThresholds(window=10))
    crossed = []
    with caplog.at_level(logging.WARNING, logger="keel.guards"):
        for i in range(10):
            crossed += monitor.record_call(
                session_id="s1", agent="support", prompt_tokens=1000 + 400 * i, retry=i >= 5
            )
    snapshot = monitor.snapshot(session_id="s1")
    assert snapshot.prompt_growth > 1.5 and snapshot.retry_rate == 0.5
    assert snapshot.retries_climbing
    assert any("prompt tokens growing" in w for w in snapshot.warnings)
    assert any("retry rate 50%" in w for w in snapshot.warnings)
    assert {snap.scope for snap in crossed} == {"session:s1", "agent:support"}
    assert "death-spiral indicators for session:s1" in caplog.text
    # One crossing, one log line per scope, however the figures move while it lasts.
    assert caplog.text.count("death-spiral indicators for session:s1") == 1
    assert monitor.snapshot(session_id="other").healthy
    assert not monitor.snapshot(agent="support").healthy


def test_state_resets_and_slow_first_tokens() -> None:
    monitor = SpiralMonitor(SpiralThresholds(max_state_resets=1, max_ttft_ms=1000))
    monitor.record_call(session_id="s", ttft_ms=5000)
    monitor.record_state_reset(session_id="s")
    assert monitor.snapshot(session_id="s").state_resets == 1
    monitor.record_state_reset(session_id="s")
    snapshot = monitor.snapshot(session_id="s")
    assert snapshot.state_resets == 2
    assert "2 state resets > 1" in snapshot.warnings
    assert any("time to first token 5000 ms" in w for w in snapshot.warnings)
    assert monitor.snapshot().calls == 1  # the process-wide scope


def test_a_window_filling_up_is_not_a_spiral(caplog: pytest.LogCaptureFixture) -> None:
    """Every session's prompt grows from a few hundred tokens to its limit: no warning."""
    monitor = SpiralMonitor(prompt_limit=8000)
    with caplog.at_level(logging.WARNING, logger="keel.guards"):
        for turn in range(40):
            prompt = min(300 + 250 * turn, 7900)  # grows, then the engine trims at the limit
            assert monitor.record_call(session_id="fresh", agent="a", prompt_tokens=prompt) == []
            snapshot = monitor.snapshot(session_id="fresh")
            assert snapshot.healthy, (turn, snapshot.warnings)
    assert snapshot.prompt_fill is not None and snapshot.prompt_fill > 0.95
    assert caplog.records == []


def test_growth_while_retries_climb_warns_and_so_does_a_full_window_failing() -> None:
    monitor = SpiralMonitor(SpiralThresholds(window=10, max_retry_rate=1.0))
    for i in range(10):
        monitor.record_call(session_id="g", prompt_tokens=1000 + 400 * i, retry=i >= 7)
    growing = monitor.snapshot(session_id="g")
    assert growing.retries_climbing and any("while retries climb" in w for w in growing.warnings)

    # Already near the limit (growth x1.1 only) while the retries pile up: a spiral as well.
    pinned = SpiralMonitor(SpiralThresholds(window=10, max_retry_rate=1.0))
    for i in range(10):
        pinned.record_call(
            session_id="p", prompt_tokens=7000 + 80 * i, retry=i >= 6, prompt_limit=8000
        )
    snapshot = pinned.snapshot(session_id="p")
    assert snapshot.prompt_growth < 1.5 and snapshot.prompt_fill is not None
    assert any("of their limit" in w for w in snapshot.warnings)
    # The same prompts without the limit known, or without retries climbing: healthy.
    unknown = SpiralMonitor(SpiralThresholds(window=10, max_retry_rate=1.0))
    for i in range(10):
        unknown.record_call(session_id="p", prompt_tokens=7000 + 80 * i, retry=i >= 6)
    assert unknown.snapshot(session_id="p").healthy


def test_a_monitor_keeps_the_windows_of_the_sessions_used_most_recently() -> None:
    # One monitor serves every run of a process, which meets sessions without end.
    monitor = SpiralMonitor(max_sessions=2)
    for name in ("s1", "s2", "s1", "s3"):
        monitor.record_call(session_id=name, agent="a", prompt_tokens=100)
    assert monitor.snapshot(session_id="s1").calls == 2  # used again after s2: kept
    assert monitor.snapshot(session_id="s3").calls == 1
    assert monitor.snapshot(session_id="s2").calls == 0  # the least recently used: dropped
    assert monitor.snapshot(agent="a").calls == 4  # agents' and the process's windows stay
    assert monitor.snapshot().calls == 4


def test_a_monitor_left_to_its_defaults_does_not_keep_every_session() -> None:
    monitor = SpiralMonitor()
    for k in range(4097):
        monitor.record_call(session_id=f"s{k}", prompt_tokens=100)
    assert monitor.snapshot(session_id="s4096").calls == 1
    assert monitor.snapshot(session_id="s0").calls == 0
