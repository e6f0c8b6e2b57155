"""The incremental conversation: turn grouping, misuse errors, cached counts."""

from __future__ import annotations

import pytest

from keel.context import ContextBudget, ContextEngine, SummaryPolicy
from keel.errors import UsageError
from keel.messages import Message, ToolCall
from keel.tokens import ChatTokenCounter, counter_for
from tests.context._helpers import text_of


class CountingCounter(ChatTokenCounter):
    """A real counter that also records how many messages it counted."""

    def __init__(self) -> None:
        base = counter_for("gpt-4o")
        super().__init__(base.profile, base.tokenizer)
        self.messages_counted = 0

    def count_message(self, message: Message) -> int:
        self.messages_counted += 1
        return super().count_message(message)


def test_tool_calls_and_results_form_one_turn() -> None:
    engine = ContextEngine("gpt-4o")
    calls = [ToolCall(id="a", name="x"), ToolCall(id="b", name="y")]
    conversation = engine.conversation(
        "s",
        [
            Message.user("hi"),
            Message.assistant("", tool_calls=calls),
            Message.tool("b", "B"),
            Message.tool("a", "A"),
            Message.assistant("done"),
        ],
    )
    assert [len(turn.messages) for turn in conversation.turns] == [1, 3, 1]
    assert all(turn.complete for turn in conversation.turns)
    assert len(conversation) == 5
    assert conversation.raw_tokens == sum(
        engine.counter.count_message(m) for m in conversation.messages
    )


def test_misuse_is_reported() -> None:
    engine = ContextEngine("gpt-4o")
    conversation = engine.conversation("s", [Message.user("hi")])
    with pytest.raises(UsageError, match="no assistant message"):
        conversation.add(Message.tool("nope", "result"))
    conversation.add(Message.assistant("", tool_calls=[ToolCall(id="c1", name="x")]))
    with pytest.raises(UsageError, match="c1 have no results yet"):
        conversation.add(Message.user("next"))
    with pytest.raises(UsageError, match="duplicate tool call ids"):
        engine.conversation(
            "t",
            [Message.assistant("", tool_calls=[ToolCall(id="d", name="x")] * 2)],
        )


def test_a_turn_still_waiting_for_results_is_left_out_of_the_prompt() -> None:
    engine = ContextEngine("gpt-4o")
    conversation = engine.conversation("s", [Message.user("hi")])
    conversation.add(Message.assistant("", tool_calls=[ToolCall(id="c1", name="x")]))
    prompt = engine.compile(conversation, system="S")
    assert [m.role for m in prompt.messages] == ["system", "user"]
    assert prompt.report.dropped[-1].reason == "tool calls still waiting for their results"


def test_compiling_never_recounts_the_history() -> None:
    counter = CountingCounter()
    engine = ContextEngine(counter, budget=ContextBudget(working_budget=4_000))
    conversation = engine.conversation("s")
    per_compile: list[int] = []
    for number in range(300):
        conversation.add(Message.user(f"question {number} " + text_of(40, number)))
        conversation.add(Message.assistant(f"answer {number} " + text_of(40, number + 1)))
        before = counter.messages_counted
        engine.compile(conversation, system="S", rules="R")
        per_compile.append(counter.messages_counted - before)
    # History messages are counted once, when added; a compile counts at most a few blocks
    # (and only when their text changed), however long the conversation.
    assert max(per_compile[10:]) <= 3
    assert len(conversation) == 600  # no summarization ran: all 600 still held
    assert counter.messages_counted < 600 + 3 * 300


def test_summary_trigger_by_turn_count() -> None:
    engine = ContextEngine("gpt-4o", summary=SummaryPolicy(max_turns=10, keep_turns=3))
    conversation = engine.conversation("s")
    for number in range(12):
        conversation.add(Message.user(f"My locker number is {number}."))
    assert conversation.needs_summary
    outcome = conversation.summarize()
    assert outcome is not None and outcome.committed and outcome.turns == 2
    assert len(conversation.turns) == 10
    assert "locker number is 0" in conversation.summary
    assert not conversation.needs_summary


def test_a_conversation_compiles_only_with_its_own_engine() -> None:
    conversation = ContextEngine("gpt-4o").conversation("s", [Message.user("hi")])
    with pytest.raises(UsageError, match="counted for another model"):
        ContextEngine("gpt-4").compile(conversation, system="S")
