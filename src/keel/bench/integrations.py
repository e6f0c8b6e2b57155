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
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_integrations_bench"]


def _recorder() -> tuple[Any, list[list[dict[str, Any]]]]:
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    inputs: list[list[dict[str, Any]]] = []

    class LooksUpThenAnswers(Model):
        async def get_response(
            self,
            system_instructions: str | None,
            input: Any,
            model_settings: Any,
            tools: Any,
            output_schema: Any,
            handoffs: Any,
            tracing: Any,
            *,
            previous_response_id: str | None,
            conversation_id: str | None,
            prompt: Any,
        ) -> Any:
            items = [dict(item) for item in input] if isinstance(input, list) else []
            inputs.append(items)
            last = items[-1] if items else {}
            n = len(inputs)
            if last.get("type") == "function_call_output":
                text = ResponseOutputText(type="output_text", text="Found it.", annotations=[])
                output: Any = ResponseOutputMessage(
                    id=f"m{n}", type="message", role="assistant", status="completed", content=[text]
                )
            else:
                asked = str(last.get("content", ""))
                output = ResponseFunctionToolCall(
                    type="function_call",
                    call_id=f"call-{n}",
                    name="lookup",
                    arguments=json.dumps({"item": asked[-12:]}),
                )
            return ModelResponse(output=[output], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    return LooksUpThenAnswers(), inputs


def _tokens(items: list[dict[str, Any]], counter: Any) -> int:
    """The input as the model's tokenizer counts its text (content, outputs, arguments)."""
    parts = []
    for item in items:
        for key in ("content", "output", "arguments"):
            value = item.get(key)
            if isinstance(value, list):  # content parts: the model reads their text
                value = "".join(str(part.get("text", "")) for part in value)
            if value is not None:
                parts.append(value if isinstance(value, str) else json.dumps(value))
    return int(counter.count_text("\n".join(parts)))


def _orphans(items: list[dict[str, Any]]) -> int:
    called = {i.get("call_id") for i in items if i.get("type") == "function_call"}
    return sum(
        1
        for i in items
        if i.get("type") == "function_call_output" and i.get("call_id") not in called
    )


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

    model, inputs = _recorder()
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
    per_call = [_tokens(items, counter) for items in inputs]
    per_turn = [max(per_call[2 * t], per_call[2 * t + 1]) for t in range(turns)]
    return {
        "turns": turns,
        "model_calls": len(inputs),
        "orphans": sum(_orphans(items) for items in inputs),
        "calls_with_orphans": sum(1 for items in inputs if _orphans(items)),
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
