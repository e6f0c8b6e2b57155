"""``keel bench integrations``: keel inside the OpenAI Agents SDK, side by side with the SDK's own
session, through the SDK's ``Runner``.

Workload: ``turns`` turns of one agent on one session. Each turn the user asks about an item,
the model calls ``lookup`` (its output 80 to 2,500 tokens, seeded) and then answers: two
model calls, four items. The model is a fake that records what the SDK sends it. The same
turns run through the SDK's ``SQLiteSession`` with ``SessionSettings(limit=...)`` (the SDK's
way to bound the history) and through keel's ``KeelSession`` with a ``window``-token context
budget, its input filter fitting each call's whole input (the turn in progress included).

Counted from what the model received, per call: orphaned tool items (a ``function_call_output``
without its ``function_call`` in the same input), overflows (inputs over the window minus the
answer's reserve, counted with the model's tokenizer), and prompt tokens at turn 100 and at
the last turn. The LangGraph half of the issue's benchmark is not built yet.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_integrations_bench"]


async def _drive(
    session: Any,
    turns: int,
    seed: int,
    progress: Callable[[str], None] | None,
    input_filter: Any = None,
) -> Any:
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    sizes = random.Random(seed)

    @function_tool
    def lookup(item: str) -> str:
        """Look an item up.

        Args:
            item: what to look up.
        """
        # Real tools answer with very different sizes: 20 to 250 lines (~80 to ~2,500 tokens).
        lines = sizes.randint(20, 250)
        return f"records for {item}: " + "a detail line about the item and its history " * lines

    from keel.testing.openai_agents import LooksUpThenAnswers

    model = LooksUpThenAnswers()
    inputs = model.inputs
    agent = Agent(name="helper", instructions="You look things up.", model=model, tools=[lookup])
    started = time.perf_counter()
    for turn in range(turns):
        await Runner.run(
            agent,
            f"Turn {turn}: what about item {turn:05d}?",
            session=session,
            run_config=RunConfig(call_model_input_filter=input_filter),
        )
        if progress is not None and (turn + 1) % 200 == 0:
            progress(f"{type(session).__name__}: {turn + 1}/{turns} turns")
    return inputs, time.perf_counter() - started


def _figures(
    inputs: list[list[dict[str, Any]]], elapsed: float, turns: int, limit: int, counter: Any
) -> dict[str, Any]:
    from keel.testing.openai_agents import orphaned_outputs, text_tokens

    per_call = [text_tokens(items, counter) for items in inputs]
    per_turn = [max(per_call[2 * t], per_call[2 * t + 1]) for t in range(turns)]
    return {
        "turns": turns,
        "model_calls": len(inputs),
        "orphans": sum(len(orphaned_outputs(items)) for items in inputs),
        "calls_with_orphans": sum(1 for items in inputs if orphaned_outputs(items)),
        "overflows": sum(1 for tokens in per_call if tokens > limit),
        "prompt_tokens_t100": per_turn[min(99, turns - 1)],
        "prompt_tokens_t1000": per_turn[-1],
        "prompt_tokens_max": max(per_turn),
        "turns_per_s": round(turns / elapsed, 1),
    }


def run_integrations_bench(
    *,
    turns: int = 1000,
    window: int = 16_000,
    sdk_limit: int = 50,
    seed: int = 7,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The Agents SDK half: the SDK's ``SQLiteSession`` (``limit=sdk_limit`` items) against
    keel's session (a ``window``-token budget), the same turns through the SDK's Runner."""
    from agents import SQLiteSession
    from agents.memory import SessionSettings

    from keel.context import ContextBudget
    from keel.integrations.openai_agents import KeelSession
    from keel.tokens import counter_for

    counter = counter_for("gpt-4o")
    with tempfile.TemporaryDirectory(prefix="keel-bench-integrations-") as name:
        folder = Path(name)
        keel = KeelSession(
            "bench",
            database=f"sqlite:///{folder / 'keel.db'}",
            model="gpt-4o",
            budget=ContextBudget(working_budget=window),
        )
        # What a prompt may take: the window less the answer's reserve (keel's default share).
        limit = keel.engine.budget.limit
        sdk = SQLiteSession(
            "bench", folder / "sdk.db", session_settings=SessionSettings(limit=sdk_limit)
        )
        sdk_inputs, sdk_s = asyncio.run(_drive(sdk, turns, seed, progress))
        keel_inputs, keel_s = asyncio.run(
            _drive(keel, turns, seed, progress, input_filter=keel.input_filter)
        )
    return {
        "openai_agents": {
            "window": window,
            "prompt_limit": limit,
            "keel": _figures(keel_inputs, keel_s, turns, limit, counter),
            "sqlite_session": {
                "limit_items": sdk_limit,
                **_figures(sdk_inputs, sdk_s, turns, limit, counter),
            },
        },
        "langgraph": None,
        "seed": seed,
    }
