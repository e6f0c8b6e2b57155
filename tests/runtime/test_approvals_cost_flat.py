"""A decision's work does not grow with its session's history when another process parked it
(issue 37: ``keel bench approvals`` saw p50 grow 4.8 -> 65.8 ms as sessions grew).

Two agents on one SQLite database stand for two service workers: one parks each turn on a
refund that waits for approval, the other decides it. The deciding worker's log of the session
is a few turns behind; it catches up by counting the messages added since, not by counting the
whole history again. What is counted is read from the context engine's conversation itself:
how many messages it counts during each decision. A log another worker rewrote (a revert) or
summarized further is built again, not caught up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.context import Conversation
from keel.messages import Message
from keel.runtime import Agent
from keel.service._access import revert_holding_lease
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool


@tool(approval=True)
def refund(order: str) -> str:
    """Refund an order.

    Args:
        order: The order id.
    """
    return f"refunded {order}"


def _policy(call: ScriptedCall) -> Message | str:
    last_user = max(i for i, m in enumerate(call.messages) if m.role == "user")
    if any(m.role == "tool" for m in call.messages[last_user:]):
        return "Done."
    return ScriptedModel.tool_call("refund", json.dumps({"order": call.last_user_text[-4:]}))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Messages the context engine's conversations have counted so far (one item, growing)."""
    count = [0]
    add = Conversation.add

    def counting_add(self: Conversation, message: Message) -> None:
        count[0] += 1
        add(self, message)

    monkeypatch.setattr(Conversation, "add", counting_add)
    return count


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    def worker() -> Agent:
        return Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You refund orders.",
            model=ScriptedModel(_policy),
            tools=[refund],
            memory=False,
        )

    parker, decider = worker(), worker()
    yield parker, decider
    parker.close()
    decider.close()


async def test_a_decision_counts_only_what_was_added_since_its_worker_last_saw_the_session(
    workers: tuple[Agent, Agent], counted: list[int]
) -> None:
    parker, decider = workers
    counted_per_decision: list[int] = []
    for n in range(12):
        parked = await parker.run(f"Refund order W{n:03d}", session="s1", user="u1")
        assert parked.status == "awaiting_approval", parked
        before = counted[0]
        decided = await decider.decide("s1", parked.approvals[0].id, approve=True, by="ops")
        assert decided.status == "completed" and decided.text == "Done.", decided
        counted_per_decision.append(counted[0] - before)
    state = decider.session_state("s1")
    assert state is not None and len(state.messages) == 12 * 6
    # Each decision counts the parked turn's four messages (the user's, the call, its
    # placeholder result, the parked reply) and its own two (the note, the answer), however
    # long the session has grown; the first, from a cold worker, the same four from the store.
    # Without the catch-up, each decision counts the whole history again: 6, 12, ..., 72.
    assert counted_per_decision == [6] * 12, counted_per_decision


async def test_a_worker_whose_log_another_worker_rewrote_builds_it_again(
    tmp_path: Path,
) -> None:
    seen: list[list[str]] = []

    def recording(call: ScriptedCall) -> str:
        seen.append([m.content for m in call.messages if m.role == "user"])
        return "Noted."

    def worker() -> Agent:
        return Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You take notes.",
            model=ScriptedModel(recording),
            memory=False,
        )

    first, second = worker(), worker()
    try:
        one = await first.run("one", session="s1", user="u1")
        two = await first.run("two", session="s1", user="u1")
        # The other worker goes back to before "two" and goes on: as long a history as the
        # first worker's log holds, with another message where "two" was.
        await revert_holding_lease(
            second, "s1", expected_version=two.state_version, to_version=one.state_version
        )
        await second.run("three", session="s1", user="u1")
        await first.run("four", session="s1", user="u1")
    finally:
        await first.aclose()
        await second.aclose()
    assert seen[-1] == ["one", "three", "four"], seen


async def test_a_worker_whose_log_another_worker_summarized_builds_it_again(
    tmp_path: Path,
) -> None:
    seen: list[list[str]] = []

    def recording(call: ScriptedCall) -> str:
        seen.append([m.content for m in call.messages if m.role in ("user", "system")])
        return "Noted."

    def worker() -> Agent:
        return Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You take notes.",
            model=ScriptedModel(recording),
            memory=False,
        )

    first, second = worker(), worker()
    try:
        await first.run("one", session="s1", user="u1")
        await first.run("two", session="s1", user="u1")
        # The other worker's turn folds the first turn into the running summary.
        key = second.session_key("s1")
        stored = await second.state.aload(key)
        runtime = stored.state.runtime.model_copy(
            update={
                "turns": 3,
                "summary": "The user first said one.",
                "messages_summarized": 2,
                "turns_summarized": 1,
            }
        )
        added = [Message.user("three", metadata={"turn": 3}), Message.assistant("Noted.")]
        summarized = stored.state.model_copy(
            update={"messages": [*stored.state.messages, *added], "runtime": runtime}
        )
        await second.state.acheckpoint(
            key, summarized, expected_version=stored.version, reason="turn"
        )
        await first.run("four", session="s1", user="u1")
    finally:
        await first.aclose()
        await second.aclose()
    prompt = seen[-1]
    assert "one" not in prompt and prompt[-3:] == ["two", "three", "four"], prompt
    assert any("The user first said one." in text for text in prompt), prompt
