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
            "the trim_messages baseline needs langchain-core: pip install 'keel-runtime[bench]'"
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


class _Tally:
    """What one benchmark run measures, call by call and turn by turn."""

    def __init__(self, engine: ContextEngine) -> None:
        self.engine = engine
        self.counter = engine.counter
        self.budget = engine.budget
        self.conversation = engine.conversation("bench")
        self.tools_tokens = self.counter.count_tools(TOOLS)
        # trim_messages knows nothing of tool schemas: give it the room they leave.
        self.lc_add, self.lc_trim = _langchain_baseline(
            self.counter.count_message,
            engine.reply_priming_tokens,
            self.budget.limit - self.tools_tokens,
        )
        self.assembly_ms: list[float] = []
        self.summary_ms: list[float] = []
        self.lc_ms: list[float] = []
        self.first_prompt_tokens: list[int] = []
        self.violations = 0
        self.violation_examples: list[str] = []
        self.max_prompt = 0
        self.degraded = 0
        self.full_tokens = (
            self.counter.count_message(Message.system(SYSTEM_PROMPT)) + engine.reply_priming_tokens
        )
        self.full_tokens += (
            self.counter.count_message(Message.system("\n".join(RULES))) + self.tools_tokens
        )
        self.full_over_budget = 0
        self.full_over_window = 0
        self.full_at: dict[int, int] = {}
        self.lc_stats = {"over_limit": 0, "orphans": 0, "lost_newest_user": 0, "max_tokens": 0}
        self.lc_first_tokens: list[int] = []
        self.summaries_committed = 0
        self.ingest_ms = 0.0
        self.compiles = 0
        self.tool_sizes: list[int] = []
        self.outside: list[int] = []

    def add(self, message: Message) -> None:
        """One message into keel's conversation (timed), the full context and the baseline."""
        started = time.perf_counter()
        self.conversation.add(message)
        self.ingest_ms += (time.perf_counter() - started) * 1000
        self.full_tokens += self.counter.count_message(message)
        self.lc_add(message)
        if message.role == "tool":
            self.tool_sizes.append(self.counter.count_text(message.content))

    def model_call(self, first: bool) -> None:
        """Compile the prompt (timed), check it, and trim the baseline's at the same point."""
        started = time.perf_counter()
        prompt = self.engine.compile(
            self.conversation, system=SYSTEM_PROMPT, rules=RULES, tools=TOOLS
        )
        self.assembly_ms.append((time.perf_counter() - started) * 1000)
        self.compiles += 1
        # Recounted message by message from a copy (the compiled tuple's count is the one the
        # engine noted with the counter as it built it: no check of it).
        exact = self.counter.count_prompt(list(prompt.messages), TOOLS)
        problems = check_prompt(
            prompt.messages, tokens=exact, limit=self.budget.limit, rules_first_line=_RULES_LINE
        )
        if exact != prompt.tokens:
            problems.append(f"report says {prompt.tokens} tokens, recount {exact}")
        if problems:
            self.violations += 1
            if len(self.violation_examples) < 5:
                self.violation_examples.append("; ".join(problems))
        self.max_prompt = max(self.max_prompt, exact)
        self.degraded += bool(prompt.report.degradations)
        if prompt.report.turns_outside_window:
            self.outside.append(prompt.report.turns_outside_window)
        if first:
            self.first_prompt_tokens.append(exact)
        self._baseline_call(first)

    def _baseline_call(self, first: bool) -> None:
        lc = self.lc_trim()
        self.lc_ms.append(lc["ms"])
        lc_tokens = lc["tokens"] + self.tools_tokens
        self.lc_stats["max_tokens"] = max(self.lc_stats["max_tokens"], lc_tokens)
        self.lc_stats["over_limit"] += lc_tokens > self.budget.limit
        self.lc_stats["orphans"] += bool(lc["orphans"])
        self.lc_stats["lost_newest_user"] += lc["lost_newest_user"]
        if first:
            self.lc_first_tokens.append(lc_tokens)

    def turn(self, number: int, messages: list[Message]) -> None:
        """One turn: the user's message, the tool calls and results, the answer; then the
        summarizer (timed apart)."""
        self.add(messages[0])
        self.model_call(first=True)
        tool_messages = list(messages[1:-1])
        if tool_messages:
            self.add(tool_messages[0])  # the assistant's tool calls
            for result in tool_messages[1:]:
                self.add(result)
            self.model_call(first=False)
        self.add(messages[-1])
        self.full_at[number] = self.full_tokens
        self.full_over_budget += self.full_tokens > self.budget.limit
        self.full_over_window += self.full_tokens > self.budget.window - self.budget.reserve
        started = time.perf_counter()
        outcome = self.conversation.summarize()
        if outcome is not None:
            self.summary_ms.append((time.perf_counter() - started) * 1000)
            self.summaries_committed += outcome.committed


_RULES_LINE = "Operating rules"
"""How the engine's rules message starts (the check finds it by this)."""


def _at(values: Sequence[int], turn: int) -> int | None:
    return values[turn - 1] if len(values) >= turn else None


def run_context_benchmark(
    turns: int = 1000,
    *,
    model: str = "gpt-4o",
    working_budget: int = 16_000,
    seed: int = 7,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module docstring)."""
    tally = _Tally(ContextEngine(model, budget=ContextBudget(working_budget=working_budget)))
    for number, messages in enumerate(synthetic_conversation(turns, seed), start=1):
        tally.turn(number, messages)
        if progress is not None:
            progress(number)
    return _report(tally, turns, model, working_budget)


def _report(tally: _Tally, turns: int, model: str, working_budget: int) -> dict[str, Any]:
    budget = tally.budget
    last = turns
    prompt_100 = _at(tally.first_prompt_tokens, min(100, turns))
    prompt_last = _at(tally.first_prompt_tokens, last)
    full_last = tally.full_at[last]
    return {
        "turns": turns,
        "model": model,
        "window": budget.window,
        "budget": working_budget,
        "reserve": budget.reserve,
        "prompt_limit": budget.limit,
        "compiles": tally.compiles,
        "violations": tally.violations,
        "violation_examples": tally.violation_examples,
        "max_prompt_tokens": tally.max_prompt,
        "prompt_tokens_turn100": prompt_100,
        f"prompt_tokens_turn{last}": prompt_last,
        "turn_last_vs_turn100": round(prompt_last / prompt_100, 4)
        if prompt_100 and prompt_last
        else None,
        "prompt_tokens_mean": round(statistics.fmean(tally.first_prompt_tokens), 1),
        # Spread of the per-turn prompt once the summary is established (turn 100 on).
        "prompt_tokens_p10_p90": _spread(tally.first_prompt_tokens[min(99, turns - 1) :]),
        "assembly_ms_p50": round(nearest_rank(tally.assembly_ms, 0.50), 4),
        "assembly_ms_p99": round(nearest_rank(tally.assembly_ms, 0.99), 4),
        "assembly_ms_max": round(max(tally.assembly_ms), 4),
        "degraded_compiles": tally.degraded,
        # Turns held raw but left out of a prompt while a large recent output took the room
        # (they return once it is pruned); the summary does not cover them meanwhile.
        "compiles_with_turns_outside_window": len(tally.outside),
        "turns_outside_window_mean": round(statistics.fmean(tally.outside), 1)
        if tally.outside
        else 0.0,
        "ingest_ms_total": round(tally.ingest_ms, 1),
        "summarizer": _summarizer_figures(tally),
        "tool_output_tokens": {
            "count": len(tally.tool_sizes),
            "min": min(tally.tool_sizes, default=0),
            "max": max(tally.tool_sizes, default=0),
        },
        "full_context_tokens_turn1000" if last == 1000 else f"full_context_tokens_turn{last}": (
            full_last
        ),
        "token_reduction_vs_full": round(1 - prompt_last / full_last, 4) if prompt_last else None,
        "baselines": _baselines(tally, turns),
    }


def _summarizer_figures(tally: _Tally) -> dict[str, Any]:
    summary_ms = tally.summary_ms
    return {
        "name": type(tally.engine.summarizer).__name__,
        "runs": len(summary_ms),
        "committed": tally.summaries_committed,
        "ms_total": round(sum(summary_ms), 2),
        "ms_p50": round(nearest_rank(summary_ms, 0.5), 3),
        "ms_max": round(max(summary_ms), 3) if summary_ms else 0.0,
        "turns_summarized": tally.conversation.turns_summarized,
        "summary_tokens": tally.conversation.summary_tokens,
    }


def _baselines(tally: _Tally, last: int) -> dict[str, Any]:
    lc_stats = tally.lc_stats
    return {
        "full_context": {
            "tokens_turn100": tally.full_at.get(min(100, last)),
            f"tokens_turn{last}": tally.full_at[last],
            "turns_over_budget": tally.full_over_budget,
            "turns_over_model_window": tally.full_over_window,
        },
        "langchain_trim_messages": {
            "prompt_tokens_turn100": _at(tally.lc_first_tokens, min(100, last)),
            f"prompt_tokens_turn{last}": _at(tally.lc_first_tokens, last),
            "max_prompt_tokens": lc_stats["max_tokens"],
            "assembly_ms_p50": round(nearest_rank(tally.lc_ms, 0.50), 4),
            "assembly_ms_p99": round(nearest_rank(tally.lc_ms, 0.99), 4),
            "over_limit": lc_stats["over_limit"],
            "prompts_with_orphans": lc_stats["orphans"],
            "prompts_missing_newest_user_message": lc_stats["lost_newest_user"],
        },
    }
