"""Shared helpers for the context tests: cheap text of a given size, invariant checks."""

from __future__ import annotations

import random
from collections.abc import Sequence

from keel.context import CompiledPrompt, ContextEngine
from keel.messages import Message

WORDS = [
    "the",
    "order",
    "flight",
    "hotel",
    "booking",
    "status",
    "price",
    "total",
    "user",
    "account",
    "item",
    "delivery",
    "shipped",
    "pending",
    "refund",
    "amount",
    "date",
    "time",
    "city",
    "seat",
    "window",
    "aisle",
    "gate",
    "terminal",
    "fare",
    "class",
]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
"""One tool schema for prompts that carry tools."""


def text_of(tokens: int, seed: int = 0) -> str:
    """About ``tokens`` o200k tokens of filler text (one token per word), cheap to build."""
    return " ".join(random.Random(seed).choices(WORDS, k=max(0, tokens)))


def check_invariants(
    engine: ContextEngine,
    prompt: CompiledPrompt,
    history: Sequence[Message],
    *,
    has_rules: bool,
) -> None:
    """Assert invariants 1-3 of DESIGN.md on one compiled prompt, independently of its report."""
    messages = prompt.messages
    budget = engine.budget
    # Recounted message by message: a copy, not the compiled tuple, whose count the engine
    # noted with its counter as it built it (``note_sum``); the tuple's must agree.
    exact = engine.counter.count_prompt(list(messages), prompt.tools)
    assert engine.counter.count_prompt(messages, prompt.tools) == exact
    # Invariant 1: exact recount, plus the reserve, within the (effective) window.
    assert exact == prompt.report.prompt_tokens
    assert exact + budget.reserve <= budget.effective_window <= budget.window
    # Invariant 2: every tool result has its call, every call has all of its results.
    calls: set[str] = set()
    answered: set[str] = set()
    for message in messages:
        calls.update(call.id for call in message.tool_calls)
        if message.role == "tool":
            assert message.tool_call_id in calls, "tool result before/without its call"
            answered.add(message.tool_call_id or "")
    assert calls == answered, f"calls without results: {calls - answered}"
    # Invariant 3: system prompt first; rules last before the newest user message.
    assert messages[0].role == "system"
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    history_users = [m for m in history if m.role == "user"]
    if history_users:
        assert users, "the newest user message was dropped"
        newest = messages[users[-1]]
        original = history_users[-1]
        assert newest.content == original.content or "keel_cut" in newest.metadata
    rules = [
        i
        for i, m in enumerate(messages)
        if m.role == "system" and m.content.startswith("Operating rules")
    ]
    if has_rules:
        expected = users[-1] - 1 if users else len(messages) - 1
        assert rules == [expected]
    else:
        assert rules == []
