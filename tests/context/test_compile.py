"""The prompt compiler: layout, exact counts, pruning, degradation order, overflow errors."""

from __future__ import annotations

import json

import pytest

from keel.context import (
    BudgetReport,
    ContextBudget,
    ContextEngine,
    ContextMemory,
    PruningPolicy,
    render_prompt,
)
from keel.errors import ContextOverflowError, UsageError
from keel.messages import Message, ToolCall
from keel.tokens import ChatTokenCounter
from tests.context._helpers import check_invariants, text_of


def tool_turn(call_id: str, output_tokens: int, seed: int = 0) -> list[Message]:
    return [
        Message.assistant("", tool_calls=[ToolCall(id=call_id, name="search", arguments="{}")]),
        Message.tool(call_id, text_of(output_tokens, seed), name="search"),
    ]


def test_layout_system_memories_summary_window_rules_newest_user() -> None:
    engine = ContextEngine("gpt-4o")
    conversation = engine.conversation(
        "s",
        [
            Message.user("My name is Ada and my booking is BK123."),
            Message.assistant("I have booked the flight to Lyon."),
            Message.user("thanks"),
            Message.assistant("You're welcome!"),
            Message.user("Which seat do I have?"),
            *tool_turn("c1", 50),
        ],
    )
    conversation.summarize(force=True)
    assert conversation.summary
    prompt = engine.compile(
        conversation,
        system="You are a travel agent.",
        rules=["Answer in one sentence.", "Never call cancel_booking."],
        memories=[ContextMemory(text="Ada prefers aisle seats", score=0.9)],
    )
    roles = [m.role for m in prompt.messages]
    assert prompt.messages[0].content == "You are a travel agent."
    assert prompt.messages[1].content.startswith("Relevant memories")
    assert "Ada prefers aisle seats" in prompt.messages[1].content
    assert prompt.messages[2].content.startswith("Summary of the earlier conversation")
    # rules right before the newest user message, the current tool turn after it
    user_at = max(i for i, role in enumerate(roles) if role == "user")
    assert prompt.messages[user_at - 1].content.startswith("Operating rules")
    assert "- Never call cancel_booking." in prompt.messages[user_at - 1].content
    assert prompt.messages[user_at].content == "Which seat do I have?"
    assert roles[user_at + 1 :] == ["assistant", "tool"]
    check_invariants(engine, prompt, conversation.messages, has_rules=True)


def test_rules_go_last_without_a_user_message() -> None:
    engine = ContextEngine("gpt-4o")
    prompt = engine.compile([Message.assistant("Hello.")], system="S", rules="Be brief.")
    assert (
        prompt.messages[-1].content
        == "Operating rules (follow them in your next answer):\nBe brief."
    )
    assert [m.role for m in prompt.messages] == ["system", "assistant", "system"]


def test_report_adds_up_and_matches_an_exact_recount() -> None:
    engine = ContextEngine("gpt-4o-mini")
    tools = [{"type": "function", "function": {"name": "search", "description": "Search."}}]
    prompt = engine.compile(
        [Message.user("hi"), *tool_turn("c1", 900)],
        system="You are helpful.",
        rules="Reply in JSON.",
        memories=["one", "two"],
        tools=tools,
    )
    report = prompt.report
    # Recounted from a copy: the compiled tuple's count is the one the engine noted.
    assert report.prompt_tokens == engine.counter.count_prompt(list(prompt.messages), tools)
    fresh = ChatTokenCounter(engine.counter.profile, engine.counter.tokenizer)
    assert fresh.count_prompt(prompt.messages, tools) == report.prompt_tokens
    assert report.sections.tools == engine.counter.count_tools(tools) > 0
    assert sum(report.sections.model_dump().values()) == report.prompt_tokens
    assert report.headroom == report.limit - report.prompt_tokens >= 0
    # The report is JSON for the trace, and reads back equal.
    data = json.loads(report.model_dump_json())
    assert data["sections"]["tools"] == report.sections.tools
    assert BudgetReport.model_validate(data).prompt_tokens == report.prompt_tokens


def test_string_rendering_has_every_message() -> None:
    engine = ContextEngine("gpt-4o")
    prompt = engine.compile([Message.user("hello"), *tool_turn("c9", 5)], system="Sys")
    text = prompt.text
    assert text.startswith("### system\nSys")
    assert "### user\nhello" in text
    assert "-> call search({}) [c9]" in text
    assert "### tool [c9]" in text
    assert text.endswith("### assistant\n")
    assert text == render_prompt(prompt.messages)
    assert prompt.to_openai()[0] == {"role": "system", "content": "Sys"}


def test_budget_resolution_working_budget_and_reserve() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(working_budget=16_000))
    budget = engine.budget
    assert budget.window == 128_000
    assert budget.effective_window == 16_000
    assert budget.reserve == 1_920  # 12% of the working budget
    assert budget.limit == 14_080
    default = ContextEngine("gpt-4o").budget
    assert default.reserve == 15_360 and default.limit == 128_000 - 15_360
    # The reserve never exceeds what the model can generate.
    capped = ContextEngine("gpt-4o", budget=ContextBudget(reserve_ratio=0.5)).budget
    assert capped.reserve == 16_384
    exact = ContextEngine("gpt-4o", budget=ContextBudget(reserve_tokens=1_000)).budget
    assert exact.reserve == 1_000
    with pytest.raises(UsageError):
        ContextEngine("gpt-4o", budget=ContextBudget(window=2_000, reserve_tokens=2_000))


def test_old_tool_output_is_pruned_with_a_marker_stating_its_size() -> None:
    engine = ContextEngine("gpt-4o", pruning=PruningPolicy(keep_recent_messages=2, max_tokens=100))
    original = text_of(3_000, seed=5)
    history = [
        Message.user("look it up"),
        Message.assistant("", tool_calls=[ToolCall(id="c1", name="search")]),
        Message.tool("c1", original),
        Message.assistant("Found it."),
        Message.user("and now?"),
    ]
    prompt = engine.compile(history, system="S")
    tool = next(m for m in prompt.messages if m.role == "tool")
    assert engine.counter.count_text(tool.content) <= 100
    assert "the original had 3000 tokens" in tool.content
    assert tool.content.startswith(original[:50])
    assert tool.content.rstrip().endswith(original[-30:])
    [pruned] = prompt.report.pruned
    assert (pruned.how, pruned.tool_call_id, pruned.original_tokens) == ("pruned", "c1", 3000)
    assert pruned.original == original  # the full output, for the trace
    assert "original" not in json.loads(prompt.report.model_dump_json())["pruned"][0]
    assert tool.metadata["keel_cut"] == {"how": "pruned", "original_tokens": 3000}


def test_recent_tool_output_is_not_pruned() -> None:
    engine = ContextEngine("gpt-4o", pruning=PruningPolicy(keep_recent_messages=6))
    original = text_of(2_000)
    prompt = engine.compile([Message.user("go"), *tool_turn("c1", 2_000)], system="S")
    assert prompt.messages[-1].content == original
    assert prompt.report.pruned == ()


def test_window_drops_oldest_whole_turns_and_reports_them() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=3_000))
    history: list[Message] = []
    for number in range(40):
        history.append(Message.user(f"question {number} " + text_of(60, number)))
        history.extend(tool_turn(f"c{number}", 80, number))
        history.append(Message.assistant(f"answer {number}"))
    prompt = engine.compile(history, system="S")
    check_invariants(engine, prompt, history, has_rules=False)
    # 40 x (user, assistant-with-its-tool-result, assistant) = 120 turns
    assert prompt.report.turns_kept < 120
    [dropped] = prompt.report.dropped
    assert dropped.section == "turns" and dropped.count == 120 - prompt.report.turns_kept
    assert prompt.report.degradations == ()
    assert prompt.messages[-1].content == "answer 39"


def test_a_message_larger_than_the_window_is_elided_in_the_middle() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=4_000))
    huge = text_of(20_000, seed=3)
    prompt = engine.compile([Message.user(huge)], system="S", rules="R")
    check_invariants(engine, prompt, [Message.user(huge)], has_rules=True)
    user = prompt.messages[-1]
    assert "middle elided to fit the context window: the original had 20000 tokens" in user.content
    assert user.content.startswith(huge[:40])
    assert [step.step for step in prompt.report.degradations] == ["elide_oversized"]
    assert prompt.report.headroom < 300  # it uses the room, it does not throw it away


def test_degradation_order_is_fixed_and_reported() -> None:
    # Floor turns with several mid-size tool outputs, memories and a summary that together
    # overflow: harder pruning first, then memories, then the summary, then elision.
    engine = ContextEngine(
        "gpt-4o",
        budget=ContextBudget(window=6_000, summary_cap=400, memories_cap=800),
        pruning=PruningPolicy(keep_recent_messages=0, max_tokens=2_000, hard_max_tokens=100),
    )
    conversation = engine.conversation("s")
    for number in range(6):
        conversation.add(Message.user(f"My order number is {number}00. Can you check it?"))
        conversation.add(Message.assistant(f"I have booked order {number}00 for Friday."))
    conversation.summarize(force=True)
    assert conversation.summary_tokens > 0
    conversation.add(Message.user("and the previous one?"))
    conversation.extend(tool_turn("old", 1_500))
    conversation.add(Message.user("check all three"))
    calls = [ToolCall(id=f"c{i}", name="search") for i in range(3)]
    conversation.add(Message.assistant("", tool_calls=calls))
    for i in range(3):
        conversation.add(Message.tool(f"c{i}", text_of(1_800, i)))
    prompt = engine.compile(
        conversation,
        system="S",
        memories=[ContextMemory(text=text_of(300, i), score=1 - i / 10) for i in range(2)],
    )
    check_invariants(engine, prompt, conversation.messages, has_rules=False)
    steps = [step.step for step in prompt.report.degradations]
    order = ["prune_tools_harder", "drop_memories", "shorten_summary", "elide_messages"]
    assert steps == [name for name in order if name in steps]
    assert steps == order
    assert all(step.tokens_saved > 0 and step.detail for step in prompt.report.degradations)


def test_a_floor_that_cannot_fit_loses_its_oldest_turns_never_the_newest_user_message() -> None:
    # One turn of 40 tool results outweighs the whole limit even pruned hard and elided.
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=2_000))
    calls = [ToolCall(id=f"c{i}", name="search") for i in range(40)]
    history = [
        Message.user("check everything"),
        Message.assistant("", tool_calls=calls),
        *(Message.tool(call.id, text_of(200, i), name="search") for i, call in enumerate(calls)),
        Message.user("and now?"),
    ]
    prompt = engine.compile(history, system="S")
    steps = [step.step for step in prompt.report.degradations]
    assert steps == ["prune_tools_harder", "elide_messages", "drop_below_floor"]
    assert "dropped below the floor" in prompt.report.degradations[-1].detail
    assert [message.content for message in prompt.messages] == ["S", "and now?"]
    assert prompt.tokens <= prompt.report.limit
    # The system prompt alone fits, with the newest user message (however elided) it does not.
    with pytest.raises(ContextOverflowError):
        engine.compile([Message.user(text_of(5_000))], system=text_of(1_740))


def test_memories_ranked_by_score_and_capped() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(memories_cap=60))
    memories = [
        ContextMemory(text="low " + text_of(30, 1), score=0.1),
        ContextMemory(text="high " + text_of(30, 2), score=0.9),
        ContextMemory(text="mid " + text_of(30, 3), score=0.5),
    ]
    prompt = engine.compile([Message.user("hi")], system="S", memories=memories)
    block = prompt.messages[1].content
    assert "high" in block and "low" not in block
    assert engine.counter.count_text(block) <= 60
    [dropped] = prompt.report.dropped
    assert dropped.section == "memories" and dropped.count == 2


def test_memories_dropped_lowest_ranked_first_when_the_prompt_overflows() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=2_000, memories_cap=900))
    memories = [ContextMemory(text=f"m{i} " + text_of(200, i), score=i) for i in range(4)]
    prompt = engine.compile(
        [
            Message.user("q " + text_of(350)),
            Message.assistant("a " + text_of(350)),
            Message.user("newest " + text_of(350)),
        ],
        system="S",
        memories=memories,
    )
    block = next(m.content for m in prompt.messages if m.content.startswith("Relevant"))
    kept = [i for i in range(4) if f"m{i} " in block]
    assert kept == sorted(kept) and 3 in kept and 0 not in kept


def test_overflow_error_names_sections_and_sizes() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=2_000))
    system = text_of(1_500)
    rules = text_of(400, 1)
    with pytest.raises(ContextOverflowError) as caught:
        engine.compile([Message.user(text_of(5_000))], system=system, rules=rules)
    error = caught.value
    assert error.limit == engine.budget.limit == 1_760
    assert error.sections["system"] == engine.counter.count_message(Message.system(system))
    assert error.sections["rules"] > 400
    assert error.sections["newest_user_message"] <= engine.pruning.min_elided_tokens + 3
    assert "system=" in str(error) and "rules=" in str(error) and "limit 1760" in str(error)


def test_no_overflow_when_only_the_system_prompt_and_a_minimal_user_message_fit() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=2_000))
    system = text_of(1_600)
    prompt = engine.compile([Message.user(text_of(9_000))], system=system)
    check_invariants(engine, prompt, [Message.user("x")], has_rules=False)
    assert prompt.tokens <= 1_760


def test_caps_on_system_and_rules_are_guards() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(system_cap=10, rules_cap=10))
    with pytest.raises(ContextOverflowError, match="system prompt exceeds its cap"):
        engine.compile([], system=text_of(50))
    with pytest.raises(ContextOverflowError, match="rules exceed their cap"):
        engine.compile([], system="S", rules=text_of(50))


def test_smallest_window_keeps_the_floor_and_current_turn() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=2_000))
    history = [Message.user("first"), Message.assistant("one")]
    history += [Message.user("now"), *tool_turn("c1", 30_000), *tool_turn("c2", 30_000, 1)]
    prompt = engine.compile(history, system="S", rules="R")
    check_invariants(engine, prompt, history, has_rules=True)
    ids = [m.tool_call_id for m in prompt.messages if m.role == "tool"]
    assert ids == ["c1", "c2"]


def test_extra_headroom_tightens_the_limit_for_a_retry() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=4_000))
    history = [Message.user(text_of(3_400))]
    normal = engine.compile(history, system="S")
    tighter = engine.compile(history, system="S", extra_headroom=500)
    assert tighter.report.limit == normal.report.limit - 500
    assert tighter.tokens <= tighter.report.limit < normal.tokens
    with pytest.raises(UsageError):
        engine.compile(history, system="S", extra_headroom=-1)


def test_a_stored_session_resumes_with_its_summary() -> None:
    engine = ContextEngine("gpt-4o")
    first = engine.conversation("s", [Message.user(f"My code is {n}.") for n in range(8)])
    first.summarize(force=True)
    resumed = engine.conversation(
        "s",
        first.messages,
        summary=first.summary,
        turns_summarized=first.turns_summarized,
    )
    assert resumed.summary == first.summary and resumed.summary_tokens == first.summary_tokens
    assert resumed.turns_summarized == first.turns_summarized == 5
    assert resumed.raw_tokens == first.raw_tokens
    prompt = engine.compile(resumed, system="S")
    assert "My code is 0." in prompt.messages[1].content
    assert prompt.report.turns_summarized == 5


def test_a_recent_giant_tool_output_takes_at_most_its_share() -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=16_000))
    history: list[Message] = []
    for number in range(20):
        history += [Message.user(f"q{number} " + text_of(40)), Message.assistant(f"a{number}")]
    history += [Message.user("read the log"), *tool_turn("big", 30_000)]
    prompt = engine.compile(history, system="S")
    check_invariants(engine, prompt, history, has_rules=False)
    report = prompt.report
    room = report.limit - report.sections.system - report.sections.reply_priming
    tool = prompt.messages[-1]
    assert engine.counter.count_message(tool) <= room * engine.pruning.recent_share
    original = engine.counter.count_text(text_of(30_000))
    assert f"tool output pruned: the original had {original} tokens" in tool.content
    assert report.turns_outside_window == 0  # every earlier turn is still in view
    assert report.degradations == ()
    assert [(p.tool_call_id, p.how, p.original_tokens) for p in report.pruned] == [
        ("big", "pruned", original)
    ]


def test_each_prompt_shows_the_summary_its_conversation_holds_now() -> None:
    """The summary block is kept while the summary is the same object: a summary rewritten
    since (a new object, even one of the same length) shows in the next prompt, and so does
    going back to one shown before."""
    engine = ContextEngine("gpt-4o")
    history = [Message.user(f"My code is {n}.") for n in range(3)]
    shown = []
    for summary in ("Codes 1 and 2.", "Codes 3 and 4.", "Codes 1 and 2.", ""):
        conversation = engine.conversation("s", history, summary=summary, turns_summarized=1)
        prompt = engine.compile(conversation, system="S")
        shown.append([m.content for m in prompt.messages if m.role == "system"])
        assert (prompt.report.sections.summary > 0) == bool(summary)
    assert "Codes 1 and 2." in shown[0][1] and "Codes 3 and 4." in shown[1][1]
    assert "Codes 1 and 2." in shown[2][1]
    assert shown[3] == ["S"], shown[3]
