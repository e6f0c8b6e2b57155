"""Long-running harnesses: the prompt stays under window minus reserve at every model call."""

from __future__ import annotations

import json
import statistics

import pytest

from keel.bench.context import RULES, SYSTEM_PROMPT, TOOLS, check_prompt, synthetic_conversation
from keel.cli import main
from keel.context import ContextBudget, ContextEngine, PruningPolicy
from keel.messages import Message


class Recounter:
    """Counts prompts independently of the engine, each distinct message object once."""

    def __init__(self, engine: ContextEngine) -> None:
        self.counter = engine.counter
        self.seen: dict[int, tuple[Message, int]] = {}
        self.tools = self.counter.count_tools(TOOLS)
        self.priming = self.counter.count_messages([]) if engine.model != "smollm2" else 0

    def __call__(self, messages: tuple[Message, ...]) -> int:
        total = self.priming + self.tools
        for message in messages:
            cached = self.seen.get(id(message))
            if cached is None or cached[0] is not message:
                cached = (message, self.counter.count_message(message))
                self.seen[id(message)] = cached
            total += cached[1]
        return total


def run_harness(turns: int, engine: ContextEngine, max_tool_tokens: int) -> list[int]:
    conversation = engine.conversation("harness")
    recount = Recounter(engine)
    first_call_tokens: list[int] = []
    limit = engine.budget.limit

    def call() -> int:
        prompt = engine.compile(conversation, system=SYSTEM_PROMPT, rules=RULES, tools=TOOLS)
        tokens = recount(prompt.messages)
        assert tokens == prompt.tokens
        assert tokens + engine.budget.reserve <= engine.budget.effective_window
        problems = check_prompt(
            prompt.messages, tokens=tokens, limit=limit, rules_first_line="Operating rules"
        )
        assert problems == []
        return tokens

    script = synthetic_conversation(turns, seed=turns, max_tool_tokens=max_tool_tokens)
    for messages in script:
        conversation.add(messages[0])
        first_call_tokens.append(call())
        if len(messages) > 2:
            conversation.extend(messages[1:-1])
            call()
        conversation.add(messages[-1])
        conversation.summarize()
    assert conversation.turns_summarized > 0
    return first_call_tokens


@pytest.mark.parametrize("window", [8_192, 32_000])
def test_100_turns_stay_under_the_window(window: int) -> None:
    engine = ContextEngine("gpt-4o", budget=ContextBudget(window=window))
    tokens = run_harness(100, engine, max_tool_tokens=20_000)
    assert max(tokens) <= engine.budget.limit


@pytest.mark.slow
def test_1000_turns_stay_under_the_working_budget_and_flat() -> None:
    engine = ContextEngine(
        "gpt-4o",
        budget=ContextBudget(working_budget=16_000),
        pruning=PruningPolicy(max_tokens=400),
    )
    tokens = run_harness(1000, engine, max_tool_tokens=20_000)
    assert max(tokens) <= engine.budget.limit == 14_080
    early = statistics.fmean(tokens[100:200])
    late = statistics.fmean(tokens[900:1000])
    assert abs(late - early) / early < 0.10


def test_bench_context_command_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "context", "--turns", "30", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["turns"] == 30 and result["budget"] == 16_000
    assert result["violations"] == 0
    assert result["max_prompt_tokens"] <= result["prompt_limit"]
    for key in (
        "prompt_tokens_turn100",
        "prompt_tokens_turn30",
        "assembly_ms_p50",
        "assembly_ms_p99",
        "token_reduction_vs_full",
    ):
        assert key in result
    assert set(result["baselines"]) == {"full_context", "langchain_trim_messages"}
    assert result["summarizer"]["name"] == "ExtractiveSummarizer"
