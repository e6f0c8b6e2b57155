"""``keel bench models``: the local model's speed and the fate of every fault kind.

The local part loads SmolLM2 in this process (cold load), then streams one greedy answer and
reports the load time, the time to the first token and the decode speed; then it sends
tool-requiring prompts with and without the tool-call grammar and counts the valid calls
(``tool_call_valid_rate``). The fault part starts
a [`FaultServer`][] on loopback and sends each fault scenario through
[`OpenAICompatibleModel`][], streamed and not, checking that each ends in the
expected typed error or in a successful retry.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.errors import (
    AuthenticationError,
    ContextLengthExceededError,
    KeelError,
    MalformedResponseError,
    ModelTimeoutError,
    ModelUnavailableError,
    RateLimitError,
    TruncatedResponseError,
)
from keel.messages import Message
from keel.models import LocalModel, ModelOptions, OpenAICompatibleModel, RetryPolicy
from keel.testing import FaultServer
from keel.testing.servers import free_port

__all__ = [
    "TOOL_SCHEMAS",
    "FaultCase",
    "bench_faults",
    "bench_local",
    "bench_tool_calls",
    "run_model_bench",
    "tool_prompts",
    "valid_call",
]


@dataclass(frozen=True)
class FaultCase:
    """One fault scenario and how it must end."""

    name: str
    scenario: str
    stream: bool
    expected: type[KeelError] | None  # None: a successful answer (after retries)
    attempts: int
    options: dict[str, Any] | None = None
    refused: bool = False  # send it to a port where nothing listens


FAULT_CASES = (
    FaultCase("rate_limit_then_ok", "rate_limit:2", False, None, 3),
    FaultCase("rate_limit_exhausted", "rate_limit", False, RateLimitError, 3),
    FaultCase("server_error_then_ok", "server_error:1", False, None, 2),
    FaultCase("server_error_then_ok_stream", "server_error:1", True, None, 2),
    FaultCase("server_error_exhausted", "server_error", True, ModelUnavailableError, 3),
    FaultCase("hang_past_timeout", "hang", False, ModelTimeoutError, 3),
    FaultCase("hang_past_timeout_stream", "hang", True, ModelTimeoutError, 3),
    FaultCase("stream_cut_midway", "cut_stream", True, TruncatedResponseError, 1),
    FaultCase("stream_cut_before_first_chunk_then_ok", "cut_early:1", True, None, 2),
    FaultCase("body_cut_then_unavailable", "cut_stream", False, ModelUnavailableError, 3),
    FaultCase("malformed_tool_arguments", "malformed_tool_args", False, MalformedResponseError, 1),
    FaultCase("malformed_tool_args_stream", "malformed_tool_args", True, MalformedResponseError, 1),
    FaultCase("finish_reason_length", "length", False, TruncatedResponseError, 1),
    FaultCase("context_length_exceeded", "context_length", False, ContextLengthExceededError, 1),
    FaultCase("unauthorized_401", "unauthorized", True, AuthenticationError, 1),
    FaultCase("connection_refused", "ok", False, ModelUnavailableError, 3, refused=True),
)
"""Every fault kind the bench checks."""


async def _one_case(case: FaultCase, base_url: str, policy: RetryPolicy) -> dict[str, Any]:
    if case.refused:
        base_url = f"http://127.0.0.1:{free_port()}/v1"
    model = OpenAICompatibleModel(
        f"{case.scenario}#{case.name}", base_url=base_url, api_key="bench", retry=policy
    )
    options = ModelOptions.model_validate(case.options or {})
    messages = [Message.user("hi")]
    started = time.perf_counter()
    got: str
    attempts: int
    try:
        if case.stream:
            final = None
            async for chunk in model.astream(messages, options=options):
                final = chunk.completion or final
            assert final is not None
            attempts = final.attempts
        else:
            attempts = (await model.acomplete(messages, options=options)).attempts
        got = "ok"
    except KeelError as exc:
        got = type(exc).__name__
        attempts = getattr(exc, "attempts", 1)
    except Exception as exc:  # an untranslated exception is exactly what the bench looks for
        got = f"untyped {type(exc).__name__}"
        attempts = 0
    finally:
        await model.aclose()
    expected = "ok" if case.expected is None else case.expected.__name__
    return {
        "scenario": case.scenario,
        "stream": case.stream,
        "expected": expected,
        "got": got,
        "attempts": attempts,
        "expected_attempts": case.attempts,
        "elapsed_s": round(time.perf_counter() - started, 3),
        "handled": got == expected and attempts == case.attempts,
    }


def bench_faults() -> dict[str, Any]:
    """Run every fault case against a local fault server; count the ones not handled."""
    policy = RetryPolicy(
        max_attempts=3,
        initial_backoff_s=0.05,
        max_backoff_s=0.2,
        attempt_timeout_s=2.0,
        max_total_s=10,
    )
    # Hangs are cut sooner; other requests get room for a slow, busy machine.
    hang_policy = policy.model_copy(update={"attempt_timeout_s": 0.5})
    with FaultServer(retry_after_s=0.2, hang_s=10) as server:

        async def run_all() -> list[dict[str, Any]]:
            # One untimed request first: the SDK's first call in a process pays for imports.
            await _one_case(FaultCase("warm_up", "ok", False, None, 1), server.base_url, policy)
            # One at a time, so the cases' timings do not disturb each other.
            return [
                await _one_case(
                    case, server.base_url, hang_policy if case.scenario == "hang" else policy
                )
                for case in FAULT_CASES
            ]

        started = time.perf_counter()
        rows = asyncio.run(run_all())
        elapsed = time.perf_counter() - started
    kinds = {case.name: row for case, row in zip(FAULT_CASES, rows, strict=True)}
    unhandled = sum(1 for row in rows if not row["handled"])
    return {
        "total": len(rows),
        "handled": len(rows) - unhandled,
        "unhandled": unhandled,
        "elapsed_s": round(elapsed, 3),
        "kinds": kinds,
    }


def bench_local(max_tokens: int = 64) -> dict[str, Any]:
    """Cold-load the bundled model, stream one greedy answer, and time it."""
    model = LocalModel()
    load_s = model.load()
    messages = [Message.user("Write three sentences about the sea.")]
    options = ModelOptions(max_tokens=max_tokens, temperature=0, allow_truncated=True)
    started = time.perf_counter()
    first: float | None = None
    final = None
    for chunk in model.stream(messages, options=options):
        if chunk.text and first is None:
            first = time.perf_counter()
        final = chunk.completion or final
    ended = time.perf_counter()
    assert final is not None
    tokens = final.usage.completion_tokens
    # ``model.stream`` hands chunks over after the fact, so the times come from the completion.
    ttft_ms = final.ttft_ms if final.ttft_ms is not None else ((first or ended) - started) * 1000
    decode_s = max(1e-9, final.latency_ms / 1000 - ttft_ms / 1000)
    return {
        "model": model.spec,
        "load_s": round(load_s, 3),
        "ttft_ms": round(ttft_ms, 1),
        "tokens_per_s": round(max(0, tokens - 1) / decode_s, 2),
        "completion_tokens": tokens,
        "prompt_tokens": final.usage.prompt_tokens,
        "total_s": round(final.latency_ms / 1000, 3),
        "n_ctx": model.n_ctx,
        "n_threads": model.n_threads,
    }


_CITIES = (
    "Paris", "Oslo", "Lima", "Pune", "Tokyo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi",
)  # fmt: skip
_WEATHER = (
    "What is the weather in {a}?",
    "Is it raining in {a} right now?",
    "Tell me the current weather for {a}.",
    "How hot is it in {a} today?",
    "Check the weather in {a}, please.",
)
_FLIGHTS = (
    "Book a flight from {a} to {b}.",
    "Please book me a flight from {a} to {b} on 2027-03-0{n}.",
    "I need a flight {a} to {b}, book it.",
    "Get me on a plane from {a} to {b}.",
    "Book flights from {a} to {b} for next week.",
)
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_flight",
            "description": "Book a flight",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination"],
            },
        },
    },
]


def tool_prompts(count: int) -> list[tuple[str, str]]:
    """``count`` prompts that need a tool, each with the tool it needs (deterministic)."""
    prompts: list[tuple[str, str]] = []
    for n in range(count):
        a, b = _CITIES[n % len(_CITIES)], _CITIES[(n * 3 + 1) % len(_CITIES)]
        if n % 2 == 0:
            template = _WEATHER[(n // 2) % len(_WEATHER)]
            prompts.append((template.format(a=a), "get_weather"))
        else:
            template = _FLIGHTS[(n // 2) % len(_FLIGHTS)]
            prompts.append((template.format(a=a, b=b, n=n % 9 + 1), "book_flight"))
    return prompts


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
}


def valid_call(
    name: str, arguments: str, tools: Sequence[Mapping[str, Any]] = TOOL_SCHEMAS
) -> bool:
    """The call names one of ``tools`` and its arguments (JSON) follow that tool's schema:
    the required ones present, no others, each of its declared scalar type."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    schema = schemas.get(name)
    if schema is None:
        return False
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    properties = schema["properties"]
    return (
        isinstance(value, dict)
        and set(schema.get("required", ())) <= set(value)
        and all(
            key in properties and isinstance(item, _JSON_TYPES[properties[key]["type"]])
            for key, item in value.items()
        )
    )


def bench_tool_calls(prompts: int = 100, max_tokens: int = 64) -> dict[str, Any]:
    """The bundled model on ``prompts`` tool-requiring prompts, with and without the call
    grammar: how often its reply holds a valid call (a real tool, schema-valid arguments).

    Two settings. ``required``: the caller knows a tool is needed (``tool_choice="required"``),
    which is ``tool_call_valid_rate``. ``auto``: the model may answer in prose instead; the
    share of replies that are a valid call, an invalid one, or prose.
    """
    cases = tool_prompts(prompts)
    report: dict[str, Any] = {"prompts": len(cases), "tool_call_valid_rate": {}, "auto": {}}
    for constrained in (True, False):
        model = LocalModel(constrain_tool_calls=constrained)
        label = "constrained" if constrained else "unconstrained"
        for choice in ("required", "auto"):
            options = ModelOptions(
                max_tokens=max_tokens,
                temperature=0,
                allow_truncated=True,
                tool_choice="required" if choice == "required" else None,
            )
            valid = invalid = right_tool = 0
            started = time.perf_counter()
            for text, expected in cases:
                completion = model.complete([Message.user(text)], TOOL_SCHEMAS, options)
                calls = completion.message.tool_calls
                good = [call for call in calls if valid_call(call.name, call.arguments)]
                if calls and len(good) == len(calls) and not completion.tool_call_errors:
                    valid += 1
                    right_tool += any(call.name == expected for call in good)
                elif calls or completion.tool_call_errors:
                    invalid += 1
            seconds = time.perf_counter() - started
            rates = {
                "valid": round(valid / len(cases), 3),
                "invalid": round(invalid / len(cases), 3),
                "prose": round((len(cases) - valid - invalid) / len(cases), 3),
                "right_tool": round(right_tool / len(cases), 3),
                "seconds": round(seconds, 1),
            }
            if choice == "required":
                report["tool_call_valid_rate"][label] = rates["valid"]
                report[f"required_{label}"] = rates
            else:
                report["auto"][label] = rates
    return report


def run_model_bench(
    *, max_tokens: int = 64, local: bool = True, tool_prompts_count: int = 100
) -> dict[str, Any]:
    """The whole ``keel bench models`` report."""
    report: dict[str, Any] = {}
    if local:
        report["local"] = bench_local(max_tokens)
        if tool_prompts_count > 0:
            tools = bench_tool_calls(tool_prompts_count)
            report["tool_call_valid_rate"] = tools["tool_call_valid_rate"]
            report["tool_calls"] = tools
    report["faults"] = bench_faults()
    return report
