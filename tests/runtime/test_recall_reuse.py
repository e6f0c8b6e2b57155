"""What consecutive turns recall again is reused (records built once, lines counted once), and
never served stale or to another user.

Two users of one agent hold earlier sessions under the same session id and turn numbers, with
different words; their turns alternate, each recalling hits with their neighbouring turns.
Each prompt's memories block holds its own user's records only, and a record forgotten or
replaced under its key between two turns is gone from the next turn's block (the new text
there), though the lines around it were recalled, built and counted the turn before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from keel.context._engine import MEMORIES_HEADING
from keel.memory import Memory, Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel

_COLOURS = {"ana": "cobalt", "ben": "crimson"}


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    prompts: list[list[Message]] = []

    def policy(call: ScriptedCall) -> str:
        prompts.append(list(call.messages))
        return "Noted."

    built = Agent.embedded(ScriptedModel(policy), system_prompt="You help.", memory=True)
    built.prompts = prompts  # type: ignore[attr-defined]
    try:
        yield built
    finally:
        await built.aclose()


def _memory(agent: Agent) -> Memory:
    assert agent.memory is not None
    return agent.memory


def _scope(agent: Agent, user: str) -> Scope:
    return Scope(tenant_id=agent.tenant_id, user_id=user)


def _earlier_session(agent: Agent, user: str) -> dict[int, str]:
    """``user``'s earlier session: the same session id and turns for every user, their own
    words in each turn. The record ids by turn."""
    memory = _memory(agent)
    ids = {}
    for turn in range(1, 9):
        record = memory.add(
            f"User: the zebra shelf {turn} of {user} is painted {_COLOURS[user]} {turn}.",
            scope=_scope(agent, user),
            kind="episodic",
            type="turn",
            session_id="old",
            turn=turn,
        )
        ids[turn] = record.id
    memory.flush()
    return ids


async def _block(agent: Agent, user: str, turn: int) -> str:
    """The memories block of ``user``'s next turn's prompt."""
    await agent.handle(f"now-{user}", user, f"zebra shelf painted, turn {turn}?")
    prompt = agent.prompts[-1]  # type: ignore[attr-defined]
    return next(m.content for m in prompt if m.role == "system" and MEMORIES_HEADING in m.content)


async def test_a_user_is_never_shown_another_users_records_recalled_alike(agent: Agent) -> None:
    for user in _COLOURS:
        _earlier_session(agent, user)
    for turn in range(4):
        for user, colour in _COLOURS.items():
            block = await _block(agent, user, turn)
            other = next(c for u, c in _COLOURS.items() if u != user)
            assert f"of {user} is painted {colour}" in block
            assert other not in block, (user, turn, block)


async def test_a_record_forgotten_or_replaced_is_not_shown_again(agent: Agent) -> None:
    ids = _earlier_session(agent, "ana")
    _earlier_session(agent, "ben")
    memory, scope = _memory(agent), _scope(agent, "ana")
    first = await _block(agent, "ana", 0)
    shown = [turn for turn in ids if f"shelf {turn} of ana" in first]
    assert len(shown) >= 3, first
    # One recalled record forgotten, another one's text replaced (its key: a new record).
    forgotten, replaced = shown[0], shown[1]
    assert memory.forget(scope, ids[forgotten])
    memory.forget(scope, ids[replaced])
    memory.add(
        f"User: the zebra shelf {replaced} of ana is painted ochre now.",
        scope=scope,
        kind="episodic",
        type="turn",
        session_id="old",
        turn=replaced,
        key=f"shelf-{replaced}",
    )
    memory.flush()
    again = await _block(agent, "ana", 1)
    assert f"shelf {forgotten} of ana" not in again, again
    assert f"shelf {replaced} of ana is painted cobalt" not in again, again
    assert f"shelf {replaced} of ana is painted ochre now" in again, again
    assert "crimson" not in again
