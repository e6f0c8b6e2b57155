"""A turn's work is what is new in it, never the session's length: counted, not timed.

One session of the ``keel bench turns`` workload (a question, one tool call, an answer), each
question holding an e-mail address, so that every prompt shows the model placeholders and its
tool call resolves one (the model passes on the tail of the question it was shown). The
profiler counts the calls of keel's own functions (generator steps included) that each turn
makes on the event loop's thread: a turn that walks the history (a scan of every message of
the prompt for placeholders, a copy validated again) makes more of them in a longer session,
one proportional to what is new makes as many at turn 100 as at turn 10. Counts are exact where
timings on a shared machine are not; only keel's frames are counted, so the event loop's own
scheduling (a thread's reply that came a little later) adds nothing. Each question has the
same length, and the medians of five turns are compared: a turn that now and then does more (a
checkpoint that is a full snapshot) moves one sample, a growth moves them all.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import keel
import keel._bridge as bridge
from tests.runtime.test_turn_cost_flat import lookup_agent

_KEEL = str(Path(keel.__file__).parent)


async def _calls_per_turn(directory: Path, turns: int) -> list[int]:
    agent = lookup_agent(directory)
    counts: list[int] = []
    count = [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_KEEL):
            count[0] += 1

    try:
        for turn in range(turns):
            count[0] = 0
            sys.setprofile(profile)
            try:
                reply = await agent.handle("long", "u1", f"look up user{turn:04d}@example.com")
            finally:
                sys.setprofile(None)
            assert reply.status == "completed" and reply.tool_calls == ("lookup",), reply
            counts.append(count[0])
    finally:
        await agent.aclose()
    return counts


@pytest.fixture
def tool_results_through_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync tool's result comes back through the event loop every time: one that had ended
    by the time its caller looked is returned at once (`run_in_thread`), and the coroutines
    that would have waited for it are then never resumed, a dozen calls fewer: which of the
    two a turn takes is up to the threads, and would move the counts by itself."""

    def through_the_loop(
        job: bridge._Job, deliver: Callable[[bridge._Outcome], None]
    ) -> bridge._Outcome | None:
        with job.lock:
            outcome = job.outcome
            if outcome is None:
                job.deliver = deliver
        if outcome is not None:
            deliver(outcome)
        return None

    monkeypatch.setattr(bridge._Job, "collect", through_the_loop)


async def test_a_turn_makes_as_many_calls_at_turn_100_as_at_turn_10(
    tmp_path: Path, tool_results_through_the_loop: None
) -> None:
    counts = await _calls_per_turn(tmp_path, 105)
    early, late = counts[10:15], counts[100:105]
    # Before the prompt's placeholders were kept as the history grew, noting what each prompt
    # showed the model walked every message of it: about 20 more calls every turn.
    # Process-wide memos another test may have filled (the traces' redaction of short texts,
    # a masker's results) can spare a turn a call or two, never a walk's worth: both ways.
    assert abs(statistics.median(late) - statistics.median(early)) <= 3, (early, late)
