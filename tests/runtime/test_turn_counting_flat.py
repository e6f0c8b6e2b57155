"""Counting a turn's prompts costs what changed in them, not the window: counted, not timed.

One session of the ``keel bench turns`` workload with memory on: every turn's prompts carry
that turn's memories as a block right after the system prompt, so each turn's first prompt
differs from the last one counted near its start. The model reports the prompt's tokens (as a
provider does) by counting it with the agent's counter; what is counted is how many messages
that counter looks up by identity during a turn. Re-counting the window from the changed block
on looks up every message of it, one more turn's worth each turn; counting from the previous
prompt where they agree looks up the messages that changed, as many at turn 40 as at turn 10.
The medians of five turns are compared (a turn that folds old turns into the summary, or finds
no memory, moves one sample; a growth moves them all).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from keel.memory import Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tokens import ChatTokenCounter
from tests.runtime.test_turn_cost_flat import lookup


class _CountedLookups(dict[int, int]):
    """The counter's identity cache, counting its look-ups."""

    looked_up = 0

    def get(self, key: int, default: Any = None) -> Any:
        type(self).looked_up += 1
        return super().get(key, default)


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here is what the records say about it."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-12:]}))


async def _lookups_per_turn(directory: Path, turns: int) -> tuple[list[int], int]:
    model = ScriptedModel(_policy)
    counter: ChatTokenCounter = model.counter
    counter._identity_counts = _CountedLookups(counter._identity_counts)
    agent = Agent.open(
        None,
        settings=load_settings(data_dir=directory, embedder="hashing:64"),
        model=model,
        system_prompt="You look records up.",
        tools=[lookup],
        memory=True,
    )
    counts: list[int] = []
    try:
        assert agent.memory is not None
        # What the user's earlier sessions left, one record per item: a turn's recall leaves
        # out its own session's turns while they are in the window, so the block each prompt
        # carries comes from here and changes with the turn's item.
        scope = Scope(tenant_id=agent.tenant_id, user_id="u1")
        for item in range(turns):
            await agent.memory.aadd(
                f"The records say item {item} is on shelf {item % 7}.",
                scope=scope,
                session_id="earlier",
            )
        await agent.memory.aflush()
        for turn in range(turns):
            _CountedLookups.looked_up = 0
            reply = await agent.handle("long", "u1", f"what do the records say about item {turn}?")
            assert reply.status == "completed" and reply.tool_calls == ("lookup",), reply
            counts.append(_CountedLookups.looked_up)
            # The turn's records embedded before the next turn, as on a quiet machine: which
            # turn first recalls a new record then never depends on the outbox worker's timing
            # (without it, a quiet run recalled the same memories turn after turn and the old
            # counter passed too).
            assert agent.memory is not None
            await agent.memory.aflush()
    finally:
        await agent.aclose()
    with_memories = sum(
        1 for call in model.calls if call.messages[1].content.startswith("Relevant memories")
    )
    return counts, with_memories


async def test_counting_a_turns_prompts_looks_up_as_many_messages_at_turn_40_as_at_10(
    tmp_path: Path,
) -> None:
    counts, with_memories = await _lookups_per_turn(tmp_path, 45)
    # The workload is what this test says it is: most prompts carry a memories block.
    assert with_memories > 60, with_memories
    early, late = counts[10:15], counts[40:45]
    # Before, each turn's first prompt was looked up message by message from the memories
    # block on: about 4 more look-ups every turn (40 more at turn 40 than at turn 30).
    assert statistics.median(late) <= statistics.median(early) + 2, (early, late)
