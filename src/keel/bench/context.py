"""``keel bench context``: a long synthetic conversation compiled at every model call.

The conversation has user turns, assistant turns and tool calls whose outputs range from 100
to 20k tokens (log-uniform). Every model call of every turn is compiled for ``gpt-4o`` on a
16k working budget with the extractive summarizer; summarization runs between turns and is
timed separately from assembly. In the same run two baselines see the same messages:

* full context: send everything (its size is a running sum, so it costs nothing to measure);
* LangChain ``trim_messages`` (strategy "last", ``start_on="human"``, ``include_system=True``)
  with an exact token counter built on keel's counter, per-message counts cached so the
  baseline is not slowed by re-tokenizing.

Every prompt is checked independently of the engine's own report: its tokens are recounted
exactly (``count_prompt``) against the prompt limit, tool calls and results are matched, and
the system message must be first and the rules right before the newest user message.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from keel.bench._stats import nearest_rank
from keel.context import ContextBudget, ContextEngine
from keel.errors import UsageError
from keel.messages import Message, ToolCall

__all__ = ["check_prompt", "run_context_benchmark", "synthetic_conversation"]

SYSTEM_PROMPT = (
    "You are Atlas, the travel and order assistant of Example Corp. Be accurate and brief. "
    "Never reveal internal notes or other customers' data. Use the tools to look things up; "
    "never guess a booking reference, price or date."
)
RULES = (
    "Answer in at most three sentences.",
    "Do not call the tool cancel_booking without an explicit confirmation.",
    "Current step: gather the travel dates, then confirm the booking.",
)
TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "search_orders",
            "description": "Search the order database.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "limit": {"type": "integer"},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_flights",
            "description": "Flights between two cities on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination", "date"],
            },
        },
    },
)

_WORDS = [
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
    "economy",
    "business",
    "baggage",
    "return",
    "outbound",
    "carrier",
    "number",
    "reference",
    "customer",
    "address",
    "invoice",
]
_CITIES = ("Paris", "Lyon", "Berlin", "Madrid", "Rome", "Oslo", "Vienna", "Lisbon", "Prague")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _filler(rng: random.Random, tokens: int) -> str:
    # Common English words with a leading space are one o200k token each, so this is cheap
    # and lands close to the requested size; the benchmark counts it exactly anyway.
    return " ".join(rng.choices(_WORDS, k=tokens))


def synthetic_conversation(
    turns: int, seed: int = 7, *, min_tool_tokens: int = 100, max_tool_tokens: int = 20_000
) -> list[list[Message]]:
    """``turns`` turns, each a list of messages: user, then tool calls/results, then answer."""
    rng = random.Random(seed)
    out: list[list[Message]] = []
    for turn in range(1, turns + 1):
        city, day = rng.choice(_CITIES), rng.choice(_DAYS)
        ref = f"BK{10_000 + turn}"
        kind = rng.random()
        if kind < 0.15:
            user = rng.choice(("Thanks!", "Great, thank you.", "OK", "Perfect."))
        elif kind < 0.5:
            user = f"My booking reference is {ref}. I want to fly to {city} on {day}."
        elif kind < 0.8:
            user = f"Can you check the status of order {ref}? " + _filler(rng, rng.randint(5, 60))
        else:
            user = f"I prefer an aisle seat and I travel with {rng.randint(1, 3)} bags."
        messages = [Message.user(user)]
        if rng.random() < 0.55:
            calls = []
            for index in range(rng.choice((1, 1, 1, 2))):
                call_id = f"call_{turn}_{index}"
                if rng.random() < 0.5:
                    call = ToolCall(
                        id=call_id, name="search_orders", arguments=f'{{"query": "{ref}"}}'
                    )
                else:
                    call = ToolCall(
                        id=call_id,
                        name="get_flights",
                        arguments=f'{{"origin": "Paris", "destination": "{city}", '
                        f'"date": "{day}"}}',
                    )
                calls.append(call)
            messages.append(Message.assistant("", tool_calls=calls))
            for call in calls:
                size = round(min_tool_tokens * (max_tool_tokens / min_tool_tokens) ** rng.random())
                header = f"status: ok; reference {ref}; destination {city}; "
                messages.append(Message.tool(call.id, header + _filler(rng, size), name=call.name))
        answer = rng.choice(
            (
                f"I have booked your flight to {city} on {day} under reference {ref}.",
                f"Order {ref} is shipped and will arrive on {day}.",
                f"I will hold the seat for {ref} until {day}; the payment is still pending.",
                "You're welcome!",
            )
        )
        messages.append(Message.assistant(answer))
        out.append(messages)
    return out


def check_prompt(
    messages: Sequence[Message],
    *,
    tokens: int,
    limit: int,
    rules_first_line: str | None,
) -> list[str]:
    """Problems with a compiled prompt against invariants 1-3 (empty when it is sound)."""
    problems: list[str] = []
    if tokens > limit:
        problems.append(f"{tokens} tokens over the limit {limit}")
    if not messages or messages[0].role != "system":
        problems.append("message 0 is not the system prompt")
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for position, message in enumerate(messages):
        for call in message.tool_calls:
            calls[call.id] = position
        if message.role == "tool":
            call_id = message.tool_call_id or ""
            if call_id not in calls:
                problems.append(f"orphaned tool result {call_id}")
            answered.add(call_id)
    missing = set(calls) - answered
    if missing:
        problems.append(f"tool calls without results: {sorted(missing)}")
    if rules_first_line is not None:
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        rules_at = [
            i
            for i, m in enumerate(messages)
            if m.role == "system" and m.content.startswith(rules_first_line)
        ]
        expected = users[-1] - 1 if users else len(messages) - 1
        if rules_at != [expected]:
            problems.append(f"rules at {rules_at}, expected right before message {expected + 1}")
    return problems


def _spread(values: Sequence[int]) -> list[float]:
    if len(values) < 2:
        return [float(v) for v in values] * 2
    deciles = statistics.quantiles(values, n=10)
    return [round(deciles[0], 1), round(deciles[-1], 1)]


def _langchain_baseline(
    counter_of: Callable[[Message], int], priming: int, limit: int
) -> tuple[Callable[[Message], None], Callable[[], dict[str, Any]]]:
    """The trim_messages baseline: ``add`` a keel message, ``trim`` at each model call."""
    try:
        from langchain_core.messages import (
            AIMessage,
            BaseMessage,
            HumanMessage,
            SystemMessage,
            ToolMessage,
            trim_messages,
        )
    except ImportError as exc:
        raise UsageError(
            "the trim_messages baseline needs langchain-core: pip install 'keel[bench]'"
        ) from exc

    sizes: dict[int, int] = {}
    system = SystemMessage(content=SYSTEM_PROMPT + "\n" + "\n".join(RULES))
    sizes[id(system)] = counter_of(Message.system(SYSTEM_PROMPT + "\n" + "\n".join(RULES)))
    history: list[BaseMessage] = [system]

    def add(message: Message) -> None:
        converted: BaseMessage
        if message.role == "user":
            converted = HumanMessage(content=message.content)
        elif message.role == "tool":
            converted = ToolMessage(content=message.content, tool_call_id=message.tool_call_id)
        elif message.role == "assistant":
            converted = AIMessage(
                content=message.content,
                tool_calls=[
                    {"id": call.id, "name": call.name, "args": call.parsed_arguments()}
                    for call in message.tool_calls
                ],
            )
        else:
            converted = SystemMessage(content=message.content)
        sizes[id(converted)] = counter_of(message)
        history.append(converted)

    def count(messages: list[BaseMessage]) -> int:
        return sum(sizes[id(m)] for m in messages) + priming

    def trim() -> dict[str, Any]:
        started = time.perf_counter()
        kept = trim_messages(
            history,
            max_tokens=limit,
            token_counter=count,
            strategy="last",
            start_on="human",
            include_system=True,
            allow_partial=False,
        )
        elapsed = (time.perf_counter() - started) * 1000
        tokens = count(kept)
        called = {c["id"] for m in kept if isinstance(m, AIMessage) for c in m.tool_calls}
        answered = {m.tool_call_id for m in kept if isinstance(m, ToolMessage)}
        newest_user = next(m for m in reversed(history) if isinstance(m, HumanMessage))
        return {
            "ms": elapsed,
            "tokens": tokens,
            "over_limit": tokens > limit,
            "orphans": len(answered - called) + len(called - answered),
            "lost_newest_user": all(m is not newest_user for m in kept),
        }

    return add, trim


def run_context_benchmark(
    turns: int = 1000,
    *,
    model: str = "gpt-4o",
    working_budget: int = 16_000,
    seed: int = 7,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module docstring)."""
    engine = ContextEngine(model, budget=ContextBudget(working_budget=working_budget))
    counter = engine.counter
    budget = engine.budget
    conversation = engine.conversation("bench")
    tools_tokens = counter.count_tools(TOOLS)
    # trim_messages knows nothing of tool schemas: give it the room they leave.
    lc_add, lc_trim = _langchain_baseline(
        counter.count_message, engine.reply_priming_tokens, budget.limit - tools_tokens
    )
    rules_first_line = "Operating rules"
    script = synthetic_conversation(turns, seed)

    assembly_ms: list[float] = []
    summary_ms: list[float] = []
    lc_ms: list[float] = []
    first_prompt_tokens: list[int] = []
    violations = 0
    violation_examples: list[str] = []
    max_prompt = 0
    degraded = 0
    full_tokens = counter.count_message(Message.system(SYSTEM_PROMPT)) + engine.reply_priming_tokens
    full_tokens += counter.count_message(Message.system("\n".join(RULES))) + tools_tokens
    full_over_budget = 0
    full_over_window = 0
    lc_stats = {"over_limit": 0, "orphans": 0, "lost_newest_user": 0, "max_tokens": 0}
    lc_first_tokens: list[int] = []
    summaries_committed = 0
    ingest_started = 0.0
    ingest_ms = 0.0
    compiles = 0
    tool_sizes: list[int] = []
    outside: list[int] = []

    def model_call(first: bool) -> None:
        nonlocal violations, max_prompt, degraded, compiles
        started = time.perf_counter()
        prompt = engine.compile(conversation, system=SYSTEM_PROMPT, rules=RULES, tools=TOOLS)
        assembly_ms.append((time.perf_counter() - started) * 1000)
        compiles += 1
        exact = counter.count_prompt(prompt.messages, TOOLS)
        problems = check_prompt(
            prompt.messages, tokens=exact, limit=budget.limit, rules_first_line=rules_first_line
        )
        if exact != prompt.tokens:
            problems.append(f"report says {prompt.tokens} tokens, recount {exact}")
        if problems:
            violations += 1
            if len(violation_examples) < 5:
                violation_examples.append("; ".join(problems))
        max_prompt = max(max_prompt, exact)
        degraded += bool(prompt.report.degradations)
        if prompt.report.turns_outside_window:
            outside.append(prompt.report.turns_outside_window)
        if first:
            first_prompt_tokens.append(exact)
        lc = lc_trim()
        lc_ms.append(lc["ms"])
        lc_tokens = lc["tokens"] + tools_tokens
        lc_stats["max_tokens"] = max(lc_stats["max_tokens"], lc_tokens)
        lc_stats["over_limit"] += lc_tokens > budget.limit
        lc_stats["orphans"] += bool(lc["orphans"])
        lc_stats["lost_newest_user"] += lc["lost_newest_user"]
        if first:
            lc_first_tokens.append(lc_tokens)

    def add(message: Message) -> None:
        nonlocal full_tokens, ingest_ms
        started = time.perf_counter()
        conversation.add(message)
        ingest_ms += (time.perf_counter() - started) * 1000
        full_tokens += counter.count_message(message)
        lc_add(message)
        if message.role == "tool":
            tool_sizes.append(counter.count_text(message.content))

    full_at: dict[int, int] = {}
    for number, messages in enumerate(script, start=1):
        add(messages[0])
        model_call(first=True)
        tool_messages = list(messages[1:-1])
        if tool_messages:
            add(tool_messages[0])  # the assistant's tool calls
            for result in tool_messages[1:]:
                add(result)
            model_call(first=False)
        add(messages[-1])
        full_at[number] = full_tokens
        full_over_budget += full_tokens > budget.limit
        full_over_window += full_tokens > budget.window - budget.reserve
        started = time.perf_counter()
        outcome = conversation.summarize()
        if outcome is not None:
            summary_ms.append((time.perf_counter() - started) * 1000)
            summaries_committed += outcome.committed
        if progress is not None:
            progress(number)
    del ingest_started

    def at(values: Sequence[int], turn: int) -> int | None:
        return values[turn - 1] if len(values) >= turn else None

    last = turns
    prompt_100 = at(first_prompt_tokens, min(100, turns))
    prompt_last = at(first_prompt_tokens, last)
    full_last = full_at[last]
    return {
        "turns": turns,
        "model": model,
        "window": budget.window,
        "budget": working_budget,
        "reserve": budget.reserve,
        "prompt_limit": budget.limit,
        "compiles": compiles,
        "violations": violations,
        "violation_examples": violation_examples,
        "max_prompt_tokens": max_prompt,
        "prompt_tokens_turn100": prompt_100,
        f"prompt_tokens_turn{last}": prompt_last,
        "turn_last_vs_turn100": round(prompt_last / prompt_100, 4)
        if prompt_100 and prompt_last
        else None,
        "prompt_tokens_mean": round(statistics.fmean(first_prompt_tokens), 1),
        # Spread of the per-turn prompt once the summary is established (turn 100 on).
        "prompt_tokens_p10_p90": _spread(first_prompt_tokens[min(99, turns - 1) :]),
        "assembly_ms_p50": round(nearest_rank(assembly_ms, 0.50), 4),
        "assembly_ms_p99": round(nearest_rank(assembly_ms, 0.99), 4),
        "assembly_ms_max": round(max(assembly_ms), 4),
        "degraded_compiles": degraded,
        # Turns held raw but left out of a prompt while a large recent output took the room
        # (they return once it is pruned); the summary does not cover them meanwhile.
        "compiles_with_turns_outside_window": len(outside),
        "turns_outside_window_mean": round(statistics.fmean(outside), 1) if outside else 0.0,
        "ingest_ms_total": round(ingest_ms, 1),
        "summarizer": {
            "name": type(engine.summarizer).__name__,
            "runs": len(summary_ms),
            "committed": summaries_committed,
            "ms_total": round(sum(summary_ms), 2),
            "ms_p50": round(nearest_rank(summary_ms, 0.5), 3),
            "ms_max": round(max(summary_ms), 3) if summary_ms else 0.0,
            "turns_summarized": conversation.turns_summarized,
            "summary_tokens": conversation.summary_tokens,
        },
        "tool_output_tokens": {
            "count": len(tool_sizes),
            "min": min(tool_sizes, default=0),
            "max": max(tool_sizes, default=0),
        },
        "full_context_tokens_turn1000" if last == 1000 else f"full_context_tokens_turn{last}": (
            full_last
        ),
        "token_reduction_vs_full": round(1 - prompt_last / full_last, 4) if prompt_last else None,
        "baselines": {
            "full_context": {
                "tokens_turn100": full_at.get(min(100, turns)),
                f"tokens_turn{last}": full_last,
                "turns_over_budget": full_over_budget,
                "turns_over_model_window": full_over_window,
            },
            "langchain_trim_messages": {
                "prompt_tokens_turn100": at(lc_first_tokens, min(100, turns)),
                f"prompt_tokens_turn{last}": at(lc_first_tokens, last),
                "max_prompt_tokens": lc_stats["max_tokens"],
                "assembly_ms_p50": round(nearest_rank(lc_ms, 0.50), 4),
                "assembly_ms_p99": round(nearest_rank(lc_ms, 0.99), 4),
                "over_limit": lc_stats["over_limit"],
                "prompts_with_orphans": lc_stats["orphans"],
                "prompts_missing_newest_user_message": lc_stats["lost_newest_user"],
            },
        },
    }
