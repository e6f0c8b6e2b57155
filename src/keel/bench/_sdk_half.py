"""The OpenAI Agents SDK half of ``keel bench integrations`` (see that module's docstring): the
SDK's ``Runner`` on its own ``SQLiteSession`` and on keel's ``KeelSession``. Needs the
openai-agents extra, which is why it is a module of its own, imported only when run."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents import Agent, RunConfig, Runner, SQLiteSession, function_tool, set_tracing_disabled
from agents.memory import SessionSettings

from keel.context import ContextBudget
from keel.integrations.openai_agents import KeelSession
from keel.testing.openai_agents import LooksUpThenAnswers, orphaned_outputs, text_tokens
from keel.tokens import counter_for

__all__ = ["run_sdk_half"]


def run_sdk_half(
    folder: Path,
    turns: int,
    window: int,
    sdk_limit: int,
    seed: int,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """``turns`` turns on the SDK's session (``limit=sdk_limit`` items) and on keel's (a
    ``window``-token budget), with databases in ``folder``; the figures of both."""
    counter = counter_for("gpt-4o")
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
        "window": window,
        "prompt_limit": limit,
        "keel": _figures(keel_inputs, keel_s, turns, limit, counter),
        "sqlite_session": {
            "limit_items": sdk_limit,
            **_figures(sdk_inputs, sdk_s, turns, limit, counter),
        },
    }


async def _drive(
    session: Any,
    turns: int,
    seed: int,
    progress: Callable[[str], None] | None,
    input_filter: Any = None,
) -> Any:
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
