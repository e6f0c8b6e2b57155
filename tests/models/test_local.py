"""The bundled SmolLM2 end to end: real generations, few and short (the machine is small)."""

from __future__ import annotations

import asyncio
import json

import pytest

from keel.bench.models import valid_call
from keel.errors import ContextLengthExceededError, ModelTimeoutError, TruncatedResponseError
from keel.messages import Message, ToolCall
from keel.models import Completion, LocalModel, ModelOptions, loaded_local_models
from keel.tokens import counter_for
from tests.models.conftest import TOOLS

pytestmark = pytest.mark.slow


async def test_real_generation_streams_and_reports_usage(local_model: LocalModel) -> None:
    messages = [Message.user("Say hello")]
    options = ModelOptions(max_tokens=24, temperature=0, allow_truncated=True)
    chunks = [chunk async for chunk in local_model.astream(messages, options=options)]
    final = chunks[-1].completion
    assert final is not None
    assert "".join(chunk.text for chunk in chunks[:-1]) == final.raw["text"]
    assert final.text and "🌟" not in final.text  # the batched-prompt bug stays worked around
    assert final.usage.prompt_tokens == counter_for("local:smollm2").count_prompt(messages)
    assert 0 < final.usage.completion_tokens <= 26
    assert final.ttft_ms is not None and final.ttft_ms <= final.latency_ms
    assert final.finish_reason in ("stop", "length")
    assert loaded_local_models()  # loaded once, shared by the process


async def test_event_loop_keeps_running_during_generation(local_model: LocalModel) -> None:
    # Counted while the generation is in flight, not against a wall-clock figure: a generation
    # that blocked the loop would finish before the loop could tick even once, however fast or
    # slow the machine is.
    generation = asyncio.create_task(
        local_model.acomplete(
            [Message.user("Name a colour.")],
            options=ModelOptions(max_tokens=16, allow_truncated=True),
        )
    )
    ticks_while_generating = 0
    while not generation.done():
        await asyncio.sleep(0.001)
        ticks_while_generating += 1
    completion = await generation
    assert completion.usage.completion_tokens >= 1
    assert ticks_while_generating >= 3  # the loop kept running while tokens were generated


async def test_required_tool_call_is_valid_json_by_grammar(local_model: LocalModel) -> None:
    completion = await local_model.acomplete(
        [Message.user("What is the weather in Paris?")],
        TOOLS,
        ModelOptions(max_tokens=40, temperature=0, tool_choice="required"),
    )
    assert completion.finish_reason == "tool_calls"
    (call,) = completion.message.tool_calls
    assert call.name in ("get_weather", "book_flight")
    assert isinstance(json.loads(call.arguments), dict)
    assert completion.tool_call_errors == ()


async def test_with_tools_offered_every_call_is_valid_for_its_schema(
    local_model: LocalModel,
) -> None:
    required = ModelOptions(max_tokens=60, temperature=0, tool_choice="required")
    for prompt in ("What is the weather in Paris?", "Book flight SK123 for 2 people."):
        completion = await local_model.acomplete([Message.user(prompt)], TOOLS, required)
        (call,) = completion.message.tool_calls
        assert valid_call(call.name, call.arguments, TOOLS), call
    # Free to answer (tool_choice auto): prose stays prose, and a call, if any, is valid.
    auto = ModelOptions(max_tokens=60, temperature=0, allow_truncated=True)
    completion = await local_model.acomplete([Message.user("Hello! Who are you?")], TOOLS, auto)
    assert completion.tool_call_errors == ()
    assert all(
        valid_call(call.name, call.arguments, TOOLS) for call in completion.message.tool_calls
    )
    assert completion.message.tool_calls or completion.text


def test_the_call_grammar_covers_every_tool_and_its_definitions() -> None:
    from llama_cpp.llama_grammar import LlamaGrammar

    from keel.models._local import _call_grammar_text

    nested = {
        "type": "function",
        "function": {
            "name": "add_people",
            "parameters": {
                "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}},
                "type": "object",
                "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/Person"}}},
                "required": ["people"],
            },
        },
    }
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for schema, required in ((None, False), (answer, False), (None, True)):
        text = _call_grammar_text([*TOOLS, nested], schema, required)
        for name in ("get_weather", "book_flight", "add_people"):
            assert f'"\\"{name}\\""' in text
        root = next(line for line in text.splitlines() if line.startswith("root ::="))
        assert ("free-text" in root) == (schema is None and not required)
        assert ("answer-json" in root) == (schema is not None)
        LlamaGrammar.from_string(text, verbose=False)  # llama.cpp accepts it


async def test_json_mode_answers_json(local_model: LocalModel) -> None:
    completion = await local_model.acomplete(
        [Message.user('Give a JSON object with a key "name" set to "Ada".')],
        options=ModelOptions(
            max_tokens=24,
            temperature=0,
            json_schema={
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
        ),
    )
    assert isinstance(json.loads(completion.text)["name"], str)


async def test_max_tokens_cut_is_typed(local_model: LocalModel) -> None:
    with pytest.raises(TruncatedResponseError) as caught:
        await local_model.acomplete(
            [Message.user("Write a long story about a dragon.")],
            options=ModelOptions(max_tokens=3, temperature=0),
        )
    partial = caught.value.raw
    assert isinstance(partial, Completion) and partial.truncated
    assert partial.usage.completion_tokens >= 1


async def test_prompt_longer_than_the_context_is_refused_before_running(
    local_model: LocalModel,
) -> None:
    huge = [Message.user("word " * 3000)]
    with pytest.raises(ContextLengthExceededError):
        await local_model.acomplete(huge, options=ModelOptions(max_tokens=16))


async def test_timeout_is_typed(local_model: LocalModel) -> None:
    with pytest.raises(ModelTimeoutError):
        await local_model.acomplete(
            [Message.user("Write a long story about a dragon.")],
            options=ModelOptions(max_tokens=200, timeout_s=0.05),
        )


def test_prompt_renders_history_tools_and_results() -> None:
    model = LocalModel(n_ctx=2048)
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    prompt = model.render_prompt(
        [
            Message.system("Be brief."),
            Message.user("Weather in Oslo?"),
            Message.assistant("", tool_calls=[call]),
            Message.tool("call_1", "12 C and rain", name="get_weather"),
        ],
        TOOLS,
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:")
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response name="get_weather">\n12 C and rain\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    plain = model.render_prompt([Message.user("hi")])
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    no_tools = model.render_prompt([Message.user("hi")], TOOLS, ModelOptions(tool_choice="none"))
    assert "<tool_call>" not in no_tools
