"""Summarizers, the summary cap, failures that lose nothing, and the memory sink."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from keel.context import (
    ContextBudget,
    ContextEngine,
    ExtractiveSummarizer,
    MemorySink,
    ModelSummarizer,
    SummaryPolicy,
    SummaryRequest,
    runtime_note,
    summarizer_for,
)
from keel.errors import ModelUnavailableError
from keel.messages import Message, ToolCall
from keel.testing import ScriptedModel
from keel.tokens import counter_for
from tests.context._helpers import check_invariants, text_of


def conversation_messages() -> list[Message]:
    return [
        Message.user("Hi there!"),
        Message.assistant("Hello! How can I help?"),
        Message.user("My booking reference is BK123. I want to fly to Lyon on Friday."),
        Message.assistant(
            "", tool_calls=[ToolCall(id="c1", name="get_flights", arguments='{"to": "Lyon"}')]
        ),
        Message.tool("c1", "AF7700 departs 09:10, 120 EUR\n" + text_of(500)),
        Message.assistant("I have booked flight AF7700 to Lyon on Friday at 09:10."),
        Message.user("Thanks!"),
        Message.user("Can you also find a hotel near the station?"),
        Message.assistant("The hotel search is still pending; I will follow up tomorrow."),
        Message.user("My booking reference is BK123. I want to fly to Lyon on Friday."),
    ]


async def test_extractive_summary_keeps_decisions_facts_actions_pending() -> None:
    summary = await ExtractiveSummarizer().summarize(
        SummaryRequest(
            previous="",
            messages=conversation_messages(),
            max_tokens=500,
            counter=counter_for("gpt-4o"),
        )
    )
    assert "Decisions:\n- I have booked flight AF7700 to Lyon on Friday at 09:10." in summary
    assert "Facts:\n- User said: My booking reference is BK123." in summary
    assert 'get_flights({"to": "Lyon"}) -> AF7700 departs 09:10, 120 EUR' in summary
    assert "Pending:" in summary and "hotel near the station" in summary
    assert "still pending" in summary
    # pleasantries and repeats are dropped
    assert "Thanks" not in summary and "Hello" not in summary and "Hi there" not in summary
    assert summary.count("BK123") == 1


async def test_extractive_summary_merges_and_stays_under_its_cap() -> None:
    counter = counter_for("gpt-4o")
    summarizer = ExtractiveSummarizer()
    summary = ""
    for batch in range(30):
        messages = [
            Message.user(f"My seat preference number {batch} is row {batch + 3}."),
            Message.assistant(f"I have booked seat {batch}A for you."),
        ]
        summary = await summarizer.summarize(
            SummaryRequest(previous=summary, messages=messages, max_tokens=120, counter=counter)
        )
        assert counter.count_text(summary) <= 120
    # the newest lines survive, the oldest made room; decisions are kept longest
    assert "seat 29A" in summary and "seat 0A" not in summary
    assert summary.index("Decisions:") < summary.index("Facts:")


async def test_summarizer_failure_loses_nothing() -> None:
    class Failing:
        async def summarize(self, request: SummaryRequest) -> str:
            raise RuntimeError("model down")

    engine = ContextEngine("gpt-4o", summarizer=Failing(), summary=SummaryPolicy(keep_turns=2))
    conversation = engine.conversation("s", conversation_messages())
    before = conversation.messages
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and not outcome.committed
    assert outcome.error == "RuntimeError: model down"
    assert conversation.messages == before
    assert conversation.summary == "" and conversation.turns_summarized == 0


async def test_summarizer_timeout_loses_nothing() -> None:
    class Slow:
        async def summarize(self, request: SummaryRequest) -> str:
            await asyncio.sleep(5)
            return "never"

    engine = ContextEngine(
        "gpt-4o", summarizer=Slow(), summary=SummaryPolicy(keep_turns=2, timeout_s=0.05)
    )
    conversation = engine.conversation("s", conversation_messages())
    before = conversation.raw_tokens
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and not outcome.committed
    assert outcome.error is not None and outcome.error.startswith("TimeoutError")
    assert conversation.raw_tokens == before and conversation.summary == ""


async def test_summary_over_its_cap_is_resummarized() -> None:
    calls: list[int] = []

    class Verbose:
        async def summarize(self, request: SummaryRequest) -> str:
            calls.append(len(request.messages))
            if request.messages:
                return text_of(500)
            return "Decisions:\n- condensed"

    engine = ContextEngine("gpt-4o", summarizer=Verbose(), budget=ContextBudget(summary_cap=100))
    conversation = engine.conversation("s", conversation_messages())
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed and outcome.resummarized
    assert calls[1] == 0  # the second call condenses the summary alone
    assert conversation.summary == "Decisions:\n- condensed"


async def test_summary_still_over_its_cap_after_condensing_is_cut() -> None:
    class Stubborn:
        async def summarize(self, request: SummaryRequest) -> str:
            return text_of(500)

    engine = ContextEngine("gpt-4o", summarizer=Stubborn(), budget=ContextBudget(summary_cap=100))
    conversation = engine.conversation("s", conversation_messages())
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed
    assert conversation.summary_tokens <= 100
    assert "middle elided to fit the context window: the original had" in conversation.summary


class RecordingSink:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.archived: list[tuple[str, list[Message], str]] = []

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        if self.fail:
            raise ConnectionError("memory store unreachable")
        self.archived.append((session_id, list(evicted), summary))


async def test_evicted_turns_and_summary_go_to_the_memory_sink_whole() -> None:
    sink = RecordingSink()
    assert isinstance(sink, MemorySink)
    engine = ContextEngine("gpt-4o", memory_sink=sink, summary=SummaryPolicy(keep_turns=2))
    conversation = engine.conversation("session-9", conversation_messages())
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed
    [(session, evicted, summary)] = sink.archived
    assert session == "session-9" and summary == conversation.summary
    # invariant 2 at the summary boundary: the call and its result were evicted together
    calls = {c.id for m in evicted for c in m.tool_calls}
    results = {m.tool_call_id for m in evicted if m.role == "tool"}
    assert calls == results == {"c1"}
    assert evicted + conversation.messages == conversation_messages()


async def test_a_failing_memory_sink_commits_nothing() -> None:
    engine = ContextEngine("gpt-4o", memory_sink=RecordingSink(fail=True))
    conversation = engine.conversation("s", conversation_messages())
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and not outcome.committed
    assert "memory store unreachable" in (outcome.error or "")
    assert conversation.messages == conversation_messages()


@pytest.mark.parametrize("by_model", [False, True], ids=["extractive", "model"])
async def test_keels_own_notes_are_never_summarized_nor_archived(by_model: bool) -> None:
    note = runtime_note("The turn above ended without an answer (model_failed).", reason="x")
    messages = [Message.user("Tell me a story about Lyon."), note, *conversation_messages()]
    model = ScriptedModel(lambda call: "Facts:\n- The user wants a story.")
    sink = RecordingSink()
    engine = ContextEngine(
        "gpt-4o",
        memory_sink=sink,
        summarizer=ModelSummarizer(model) if by_model else None,
        summary=SummaryPolicy(keep_turns=2),
    )
    conversation = engine.conversation("s", messages)
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed
    [(_, evicted, summary)] = sink.archived
    # The note is folded away with its turn (counted), but no summary or archive holds it.
    assert note not in evicted and Message.user("Tell me a story about Lyon.") in evicted
    assert outcome.messages == len(evicted) + 1
    assert "keel runtime note" not in summary and "without an answer" not in summary
    if by_model:
        assert "without an answer" not in model.calls[0].messages[1].content
        assert "story about Lyon" in model.calls[0].messages[1].content


async def test_a_model_summary_holds_only_the_placeholders_it_was_given() -> None:
    """A summarizing model that writes a placeholder its input did not hold (a tool's text,
    defanged, turned back into one) does not make it a placeholder: the summary reaches every
    later prompt, where placeholders resolve (issue 44, defect 11)."""
    model = ScriptedModel(["Facts:\n- Mail <EMAIL_1>, card <CREDIT_CARD_1>."])
    engine = ContextEngine("gpt-4o", summarizer=ModelSummarizer(model))
    given = [Message.user("My email is <EMAIL_1>."), Message.assistant("Noted.")]
    conversation = engine.conversation("s", [*given, *conversation_messages()])
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed
    assert "<EMAIL_1>" in model.calls[0].messages[1].content
    assert conversation.summary == "Facts:\n- Mail <EMAIL_1>, card \u2039CREDIT_CARD_1\u203a."


async def test_model_summarizer_prompt_and_result() -> None:
    model = ScriptedModel(["Decisions:\n- Booked AF7700 to Lyon (Friday 09:10)."])
    engine = ContextEngine("gpt-4o", summarizer=ModelSummarizer(model))
    conversation = engine.conversation("s", conversation_messages())
    outcome = await conversation.asummarize(force=True)
    assert outcome is not None and outcome.committed
    assert conversation.summary == "Decisions:\n- Booked AF7700 to Lyon (Friday 09:10)."
    [call] = model.calls
    instructions, body = call.messages[0].content, call.messages[1].content
    for kind in ("Decisions", "Facts", "Actions", "Pending"):
        assert kind in instructions
    assert "My booking reference is BK123" in body
    assert "[assistant called get_flights" in body
    assert "the original had" in body  # long tool output cut for the summarizer
    assert call.options.temperature == 0.0
    assert call.options.max_tokens == engine.budget.summary_cap


async def test_model_summarizer_failure_keeps_raw_turns_and_retries_later() -> None:
    model = ScriptedModel(
        [ModelUnavailableError("503", model="m"), "Facts:\n- User reference BK123."]
    )
    engine = ContextEngine("gpt-4o", summarizer=ModelSummarizer(model))
    conversation = engine.conversation("s", conversation_messages())
    first = await conversation.asummarize(force=True)
    assert first is not None and not first.committed and len(conversation) == 10
    second = await conversation.asummarize(force=True)
    assert second is not None and second.committed
    assert conversation.summary == "Facts:\n- User reference BK123."
    prompt = engine.compile(conversation, system="S", rules="R")
    check_invariants(engine, prompt, conversation.messages, has_rules=True)
    assert "BK123" in prompt.messages[1].content


def test_sync_twin_and_nothing_to_do() -> None:
    engine = ContextEngine("gpt-4o")
    conversation = engine.conversation("s", [Message.user("hi")])
    assert conversation.summarize() is None
    assert conversation.summarize(force=True) is None  # the floor is never summarized


@pytest.mark.parametrize("summary_cap", [60, 400])
def test_compiled_summary_respects_its_cap(summary_cap: int) -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(summary_cap=summary_cap))
    conversation = engine.conversation("s", conversation_messages() * 1)
    conversation.summarize(force=True)
    assert 0 < conversation.summary_tokens <= summary_cap


def test_default_summarizer_follows_the_configured_model() -> None:
    assert isinstance(summarizer_for(None), ExtractiveSummarizer)
    assert isinstance(summarizer_for(ScriptedModel(model="gpt-4")), ExtractiveSummarizer)  # 8k
    chosen = summarizer_for(ScriptedModel(model="gpt-4o"))
    assert isinstance(chosen, ModelSummarizer) and chosen.model.profile.name == "gpt-4o"


def _fold_messages(fold: int) -> list[Message]:
    """One fold's turns: a fact, a repeat of an older fact, a decision, a tool call."""
    return [
        Message.user(f"My order number is {fold}. My order number is {fold // 3}."),
        Message.assistant(f"I have booked slot {fold % 4} for you."),
        Message.assistant(
            "", tool_calls=[ToolCall(id=f"c{fold}", name="lookup", arguments=f'{{"n": {fold}}}')]
        ),
        Message.tool(f"c{fold}", f"order {fold}: shipped"),
    ]


def test_a_summary_extended_from_its_last_text_equals_one_read_afresh() -> None:
    """The summarizer starts from its last summary's parsed lines when given that text back:
    the summaries are those a summarizer reading every ``previous`` afresh writes, lines that
    the cap dropped come back when said again, and a ``previous`` it did not write is read."""
    counter = counter_for("gpt-4o")
    kept = ExtractiveSummarizer()
    previous = ""
    for fold in range(40):
        # A cap that drops old lines from fold 10 on; a text it did not write at fold 25.
        if fold == 25:
            previous = "Facts:\n- User said: My order number is 7.\n- Free text\nFree text"
        request = SummaryRequest(
            previous=previous,
            messages=_fold_messages(fold),
            max_tokens=120,
            counter=counter,
        )
        fresh = ExtractiveSummarizer().summarize_sync(request)
        extended = kept.summarize_sync(request)
        assert extended == fresh, fold
        assert counter.count_text(extended) <= 120
        previous = extended
    # The repeat of fold 39 // 3 = 13, dropped by the cap long ago, is a line again.
    assert "User said: My order number is 13." in previous
