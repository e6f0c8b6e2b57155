"""The tool-call parser on hand-written edge cases and on outputs SmolLM2 really produced."""

from __future__ import annotations

import json

import pytest

from keel.messages import Message, ToolCall
from keel.models import LocalModel, ModelOptions, parse_tool_calls, render_tools_prompt
from keel.models._lenient_json import LenientJSONError, loads
from tests.models.conftest import TOOLS

# Replies SmolLM2-135M-Instruct gave (temperature 0) to prompts offering TOOLS, kept verbatim.
REAL_OUTPUTS = {
    "bare_json": '{ "name": "get_weather", "arguments": { "city": "Paris" } }',
    "parroted_instructions_extra_brace_cut_tag": (
        "To call a tool, answer with only a tool call block, like this:\n<tool_call>\n"
        '{"name": "book_flight", "arguments": {"city": "London", "date": "2025-05-01"}}}\n'
        "</tool_"
    ),
    "python_code_in_fence": (
        'You can call the "get_weather" tool using the following code:\n```\nimport json\n\n'
        "def get_weather_json(city: str):\n    return json.dumps({\n"
        '        "name": "get_weather",\n        "arguments": {\n            "city": city\n'
        "        }"
    ),
    "prose_only": (
        "Paris, France, is known for its vibrant culture and stunning landscapes. The weather "
        "in Paris is quite unique, with a mix of Mediterranean and Continental styles."
    ),
}


def args(call: ToolCall) -> object:
    return json.loads(call.arguments)


def test_real_bare_json_object() -> None:
    parsed = parse_tool_calls(REAL_OUTPUTS["bare_json"], TOOLS)
    assert [(c.name, args(c)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.ok and parsed.text == ""


def test_real_tag_with_extra_brace_and_cut_closing_tag() -> None:
    parsed = parse_tool_calls(REAL_OUTPUTS["parroted_instructions_extra_brace_cut_tag"], TOOLS)
    assert [(c.name, args(c)) for c in parsed.calls] == [
        ("book_flight", {"city": "London", "date": "2025-05-01"})
    ]
    assert parsed.text.startswith("To call a tool")


def test_real_python_code_becomes_a_typed_error_not_an_exception() -> None:
    parsed = parse_tool_calls(REAL_OUTPUTS["python_code_in_fence"], TOOLS)
    assert parsed.calls == ()
    assert len(parsed.errors) == 1
    error = parsed.errors[0]
    assert "not valid JSON" in error.reason
    assert "<tool_call>" in error.feedback()


def test_real_prose_is_just_text() -> None:
    parsed = parse_tool_calls(REAL_OUTPUTS["prose_only"], TOOLS)
    assert parsed.calls == () and parsed.errors == ()
    assert parsed.text == REAL_OUTPUTS["prose_only"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            "```json\n{'name': 'get_weather', 'arguments': {'city': 'Oslo',},}\n```",
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            'Sure! {"tool": "get_weather", "args": {"city": "Oslo"}} Hope that helps.',
            [("get_weather", {"city": "Oslo"})],
        ),
        ('{"name": "get_weather", "city": "Oslo"}', [("get_weather", {"city": "Oslo"})]),
        ('{"get_weather": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
        (
            '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            '{"type": "function", "function": '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}}',
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "book_flight", "arguments": {"origin": "Oslo", "destination": "Rome"}}]'
            "</tool_call>",
            [
                ("get_weather", {"city": "Oslo"}),
                ("book_flight", {"origin": "Oslo", "destination": "Rome"}),
            ],
        ),
        (
            "<tool_call>{name: get_weather, arguments: {city: 'Oslo', metric: True}}</tool_call>",
            None,
        ),  # bare words as values are not guessed at
        ('get_weather(city="Oslo")', [("get_weather", {"city": "Oslo"})]),
        ("<tool_call>\u201cname\u201d</tool_call>", None),
        (
            '{"name": "get_weather", "arguments": {"city": "Oslo", "days": None, "ok": True}}',
            [("get_weather", {"city": "Oslo", "days": None, "ok": True})],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {} }\n</tool_call>',
            [("get_weather", {})],
        ),
    ],
)
def test_edge_cases(text: str, expected: list[tuple[str, object]] | None) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    if expected is None:
        assert parsed.calls == () and len(parsed.errors) == 1
    else:
        assert [(c.name, args(c)) for c in parsed.calls] == expected
        assert parsed.errors == ()
    assert all(c.id.startswith("call_") for c in parsed.calls)


def test_unknown_tool_is_an_error_with_suggestion() -> None:
    parsed = parse_tool_calls('{"name": "get_wether", "arguments": {"city": "Oslo"}}', TOOLS)
    assert parsed.calls == ()
    assert parsed.errors[0].tool == "get_wether"
    assert "did you mean get_weather" in parsed.errors[0].reason


def test_cut_off_call_is_marked_truncated() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Os', TOOLS)
    assert parsed.calls == ()
    assert parsed.errors[0].truncated


def test_arguments_that_are_not_an_object_are_an_error() -> None:
    parsed = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>', TOOLS
    )
    assert parsed.calls == () and "must be a JSON object" in parsed.errors[0].reason


def test_json_answers_without_a_tool_name_are_text() -> None:
    text = 'The result is {"temperature": 21, "unit": "C"}.'
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == () and parsed.errors == () and parsed.text == text


def test_lenient_json_reader() -> None:
    assert loads("{'a': [1, 2,], b: 'x', // note\n 'c': None}") == {
        "a": [1, 2],
        "b": "x",
        "c": None,
    }
    with pytest.raises(LenientJSONError) as caught:
        loads('{"a": "b')
    assert caught.value.unclosed
    with pytest.raises(LenientJSONError):
        loads('{"a": 1} extra')


def test_tools_prompt_names_every_tool_and_the_format() -> None:
    prompt = render_tools_prompt(TOOLS)
    assert "get_weather(city: string): Get the current weather for a city" in prompt
    assert "book_flight(origin: string, destination: string, date?: string)" in prompt
    assert "<tool_call>" in prompt


@pytest.mark.slow
def test_parser_on_fresh_outputs_of_the_local_model(local_model: LocalModel) -> None:
    """Generate with a fixed seed at temperature 0 and read whatever comes out."""
    options = ModelOptions(max_tokens=40, temperature=0, seed=1, allow_truncated=True)
    prompts = [
        [
            Message.system("You are a tool-calling assistant. Always answer with a tool call."),
            Message.user("Book a flight from London to Rome on 2025-05-01."),
        ],
        [Message.user("What is the weather in Paris?")],
    ]
    for messages in prompts:
        completion = local_model.complete(messages, TOOLS, options)
        text = completion.raw["text"]
        reparsed = parse_tool_calls(text, TOOLS)  # never raises, whatever the model wrote
        assert [c.name for c in reparsed.calls] == [c.name for c in completion.message.tool_calls]
        assert len(reparsed.errors) == len(completion.tool_call_errors)
        for call in completion.message.tool_calls:
            assert call.name in ("get_weather", "book_flight")
            assert isinstance(json.loads(call.arguments), dict)
        for error in completion.tool_call_errors:
            assert error.reason and error.feedback()
