"""A turn's work does not grow with the session's history, measured where users stand.

Each test seeds a session with a long history (its old turns folded into the summary, as a
long-running session has them), runs turns through ``Agent.handle``, and reads from
``tracemalloc`` the most memory a turn held beyond what it started with. Anything a turn does
that is proportional to the history (copying the message list, comparing it item by item,
validating or encoding it again) needs at least a list of that length while it runs, so the
figure would grow with the history; work proportional to what is new keeps it flat. Memory
counts are nearly deterministic, unlike timings on a loaded machine, but not quite:
``tracemalloc`` counts every thread of the process, and on a loaded machine one turn's window
now and then takes in work that is no part of it (a lease renewal that came due, a pool thread
or a thread left by another test allocating at that moment). Such a one-off lands in one turn;
work proportional to the history is done by every turn. So each session runs several turns and
the tests compare their medians, which one stray sample cannot move and a growth in every turn
does.
"""

from __future__ import annotations

import gc
import json
import statistics
import tracemalloc
from pathlib import Path

from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.state import AgentState, SessionRuntime
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    return f"the record for {query}"


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here it is."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-12:]}))


def lookup_agent(directory: Path) -> Agent:
    """The ``keel bench turns`` agent (memory off) on a database in ``directory``."""
    return Agent.open(
        None,
        settings=load_settings(data_dir=directory, embedder="hashing:64"),
        model=ScriptedModel(_policy),
        system_prompt="You look records up.",
        tools=[lookup],
        memory=False,
    )


async def _turn_peaks(directory: Path, history: int, turns: int = 5) -> list[int]:
    """The transient memory peak (bytes) of each of ``turns`` turns of a session that starts
    with ``history`` messages."""
    agent = lookup_agent(directory)
    try:
        key = agent.session_key("long")
        messages: list[Message] = []
        for n in range(history // 2):
            messages += [
                Message.user(f"question {n}", metadata={"turn": n + 1}),
                Message.assistant(f"answer {n}"),
            ]
        seeded = AgentState(
            max_steps=10**9,
            step=history,
            messages=messages,
            runtime=SessionRuntime(
                tenant_id=agent.tenant_id,
                user_id="u1",
                turns=history // 2,
                summary="Earlier the user asked numbered questions.",
                messages_summarized=history - 2,
                turns_summarized=history // 2 - 1,
            ),
        )
        created = await agent.state.acreate(key, seeded)
        await agent.state.amark(key, created.version, good=True)
        del messages, seeded, created
        # The first turn reads the session in (once per process, like any cold start).
        assert (await agent.handle("long", "u1", "hello")).status == "completed"
        peaks: list[int] = []
        tracemalloc.start()
        try:
            for n in range(turns):
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                reply = await agent.handle("long", "u1", f"look up item {n}")
                peaks.append(tracemalloc.get_traced_memory()[1] - before)
                assert reply.status == "completed" and reply.tool_calls == ("lookup",)
        finally:
            tracemalloc.stop()
        state = agent.session_state("long")
        assert state is not None and len(state.messages) == history + 4 * (turns + 1)
        return peaks
    finally:
        await agent.aclose()


async def test_a_turn_holds_no_more_memory_after_40000_messages_than_after_400(
    tmp_path: Path,
) -> None:
    short = await _turn_peaks(tmp_path / "short", 400)
    long = await _turn_peaks(tmp_path / "long", 40_000)
    # One copy of a 40,000-message list alone is 320 KB; a turn of either session holds
    # about 90 KB beyond what it started with. The median of five turns, not the most: a
    # full random-order run once saw ([98402, 93743, 94137], [95807, 90818, 680705]), one
    # turn of the long session taking in 590 KB that its other turns (and the short
    # session's) did not: not the history, which every turn would pay for.
    assert statistics.median(long) < statistics.median(short) + 128 * 1024, (short, long)
