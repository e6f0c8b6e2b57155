"""Property tests: invariants 1-3 hold for random conversations, sizes and windows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from keel.context import (
    ContextBudget,
    ContextEngine,
    ContextMemory,
    ExtractiveSummarizer,
    PruningPolicy,
    SummaryPolicy,
    SummaryRequest,
)
from keel.errors import ContextOverflowError
from keel.messages import Message, ToolCall
from tests.context._helpers import TOOLS, check_invariants, text_of

sizes = st.one_of(st.integers(0, 300), st.integers(300, 5_000), st.integers(5_000, 50_000))
# Sizes relative to the effective window, in thousandths: many mid-size messages that each fit
# but together overflow, which is what drives the degradation steps other than elision.
relative = st.integers(20, 450)


@dataclass
class TurnSpec:
    kind: str
    sizes: list[int]
    relative: bool = False


turn_specs = st.one_of(
    st.builds(TurnSpec, st.just("user"), st.lists(sizes, min_size=1, max_size=1)),
    st.builds(TurnSpec, st.just("user"), st.lists(relative, min_size=1, max_size=1), st.just(True)),
    st.builds(
        TurnSpec, st.just("assistant"), st.lists(st.integers(0, 2_000), min_size=1, max_size=1)
    ),
    st.builds(TurnSpec, st.just("tools"), st.lists(sizes, min_size=1, max_size=3)),
    st.builds(
        TurnSpec, st.just("tools"), st.lists(relative, min_size=1, max_size=3), st.just(True)
    ),
    st.builds(TurnSpec, st.just("huge_user"), st.lists(st.integers(1, 3), min_size=1, max_size=1)),
    st.builds(TurnSpec, st.just("system"), st.lists(st.integers(1, 200), min_size=1, max_size=1)),
)


def build_history(specs: list[TurnSpec], window: int, seed: int) -> list[Message]:
    messages: list[Message] = []
    for number, spec in enumerate(specs):
        tag = f"t{number}"
        spec_sizes = [window * size // 1000 for size in spec.sizes] if spec.relative else spec.sizes
        if spec.kind == "user":
            messages.append(Message.user(f"{tag} " + text_of(spec_sizes[0], seed + number)))
        elif spec.kind == "huge_user":
            # A single message larger than the whole window.
            size = window * spec.sizes[0] // 2 + window // 2
            messages.append(Message.user(f"{tag} " + text_of(size, seed + number)))
        elif spec.kind == "assistant":
            messages.append(Message.assistant(f"{tag} " + text_of(spec_sizes[0], seed)))
        elif spec.kind == "system":
            messages.append(Message.system(f"{tag} note " + text_of(spec_sizes[0], seed)))
        else:
            calls = [
                ToolCall(id=f"{tag}_{i}", name="lookup", arguments=f'{{"query": "{tag}"}}')
                for i in range(len(spec_sizes))
            ]
            messages.append(Message.assistant("", tool_calls=calls))
            for call, size in zip(calls, spec_sizes, strict=True):
                messages.append(Message.tool(call.id, text_of(size, seed + size), name="lookup"))
    return messages


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    window=st.one_of(st.integers(2_000, 12_000), st.integers(12_000, 200_000)),
    working=st.one_of(st.none(), st.integers(2_000, 200_000)),
    reserve_ratio=st.floats(0.05, 0.3),
    system_size=st.integers(1, 400),
    system_permille=st.one_of(st.none(), st.integers(100, 1_100)),
    rules=st.lists(st.integers(1, 120), max_size=3),
    memories=st.lists(st.tuples(st.integers(1, 3_000), st.floats(0, 1)), max_size=6),
    specs=st.lists(turn_specs, max_size=14),
    summarize=st.booleans(),
    with_tools=st.booleans(),
    seed=st.integers(0, 1_000),
)
def test_invariants_hold_for_random_conversations(
    window: int,
    working: int | None,
    reserve_ratio: float,
    system_size: int,
    system_permille: int | None,
    rules: list[int],
    memories: list[tuple[int, float]],
    specs: list[TurnSpec],
    summarize: bool,
    with_tools: bool,
    seed: int,
) -> None:
    engine = ContextEngine(
        "gpt-4o",
        budget=ContextBudget(window=window, working_budget=working, reserve_ratio=reserve_ratio),
        pruning=PruningPolicy(keep_recent_messages=seed % 8),
    )
    history = build_history(specs, engine.budget.effective_window, seed)
    conversation = engine.conversation("prop", history)
    if summarize:
        outcome = conversation.summarize(force=True)
        assert outcome is None or outcome.committed
    if system_permille is not None:
        system_size = engine.budget.effective_window * system_permille // 1000
    system = "You are a careful assistant. " + text_of(system_size, seed)
    rule_texts = [f"Rule {i}: " + text_of(size, seed + i) for i, size in enumerate(rules)]
    memory_items = [
        ContextMemory(text=f"memory {i} " + text_of(size, i), score=score)
        for i, (size, score) in enumerate(memories)
    ]
    tools = TOOLS if with_tools else []
    try:
        prompt = engine.compile(
            conversation, system=system, rules=rule_texts, memories=memory_items, tools=tools
        )
    except ContextOverflowError as exc:
        # Only when the irreducible part truly cannot fit: system + rules + tools (+ the
        # newest user message cut to its minimal form).
        counter = engine.counter
        fixed = counter.count_prompt([Message.system(system)], tools)
        if rule_texts:
            fixed += exc.sections["rules"]
        has_user = any(m.role == "user" for m in conversation.messages)
        minimal_user = engine.pruning.min_elided_tokens + 3 if has_user else 0
        assert exc.sections["system"] == counter.count_message(Message.system(system))
        assert fixed + minimal_user > engine.budget.limit
        assert exc.limit == engine.budget.limit
        event("overflow error")
        return
    check_invariants(engine, prompt, conversation.messages, has_rules=bool(rule_texts))
    report = prompt.report
    for step in report.degradations:
        event(f"degradation: {step.step}")
    if report.summary_cap and report.sections.summary:
        event("summary in prompt")
    sections = report.sections
    assert (
        sections.system
        + sections.memories
        + sections.summary
        + sections.turns
        + sections.rules
        + sections.tools
        + sections.reply_priming
        == report.prompt_tokens
    )
    assert sections.memories <= report.memories_cap + 50  # framing and heading aside


class FlakySummarizer:
    """The extractive summarizer, failing on the calls the test chooses."""

    def __init__(self, failures: list[bool]) -> None:
        self.failures = failures
        self.calls = 0
        self.inner = ExtractiveSummarizer()

    async def summarize(self, request: SummaryRequest) -> str:
        fail = self.failures[self.calls % len(self.failures)] if self.failures else False
        self.calls += 1
        if fail:
            raise RuntimeError("summarizer failed")
        return await self.inner.summarize(request)


class ArchiveSink:
    def __init__(self) -> None:
        self.evicted: list[Message] = []

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        self.evicted.extend(evicted)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(2_000, 20_000),
    specs=st.lists(turn_specs, min_size=1, max_size=25),
    failures=st.lists(st.booleans(), max_size=4),
    seed=st.integers(0, 1_000),
)
def test_summarizing_loses_nothing_and_keeps_tool_turns_whole(
    window: int, specs: list[TurnSpec], failures: list[bool], seed: int
) -> None:
    sink = ArchiveSink()
    engine = ContextEngine(
        "gpt-4o",
        budget=ContextBudget(window=window),
        summarizer=FlakySummarizer(failures),
        summary=SummaryPolicy(keep_turns=2),
        memory_sink=sink,
    )
    conversation = engine.conversation("prop")
    added: list[Message] = []
    for message in build_history(specs, window, seed):
        conversation.add(message)
        added.append(message)
        if message.role != "tool" and not message.tool_calls:
            prompt = engine.compile(conversation, system="S", rules="R")
            check_invariants(engine, prompt, added, has_rules=True)
            conversation.summarize()
    conversation.summarize(force=True)
    event(f"turns summarized: {min(conversation.turns_summarized, 3)}+")
    # Every message is either archived (with its whole turn) or still held, in order.
    assert sink.evicted + conversation.messages == added
    calls = {call.id for m in sink.evicted for call in m.tool_calls}
    results = {m.tool_call_id for m in sink.evicted if m.role == "tool"}
    assert calls == results
    assert conversation.summary_tokens <= engine.budget.summary_cap
