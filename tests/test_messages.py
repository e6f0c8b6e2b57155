from __future__ import annotations

import pytest
from pydantic import ValidationError

from keel import Message, ToolCall, Usage


def _conversation() -> list[Message]:
    call = ToolCall(id="call_1", name="search_flights", arguments='{"origin": "LHR"}')
    return [
        Message.system("You book flights."),
        Message.user("Find me a flight", name="ada", metadata={"turn": 1}),
        Message.assistant("", tool_calls=[call]),
        Message.tool("call_1", '{"flights": []}', name="search_flights"),
        Message.assistant("No flights found. 你好 ✈️"),
    ]


@pytest.mark.parametrize("message", _conversation())
def test_json_round_trip_is_exact(message: Message) -> None:
    restored = Message.model_validate_json(message.model_dump_json())
    assert restored == message
    assert restored.model_dump_json() == message.model_dump_json()


def test_tool_message_requires_call_id() -> None:
    with pytest.raises(ValidationError, match="tool_call_id"):
        Message(role="tool", content="result")


def test_only_assistant_carries_tool_calls() -> None:
    with pytest.raises(ValidationError, match="only assistant"):
        Message(role="user", content="x", tool_calls=(ToolCall(id="a", name="b"),))


def test_tool_call_id_only_on_tool_messages() -> None:
    with pytest.raises(ValidationError, match="tool_call_id belongs"):
        Message(role="user", content="x", tool_call_id="call_1")


def test_unknown_role_and_extra_fields_rejected() -> None:
    with pytest.raises(ValidationError):
        Message.model_validate({"role": "robot", "content": "x"})
    with pytest.raises(ValidationError):
        Message.model_validate({"role": "user", "content": "x", "colour": "red"})


def test_openai_wire_format() -> None:
    assistant = _conversation()[2]
    wire = assistant.to_openai()
    assert wire["content"] is None
    assert wire["tool_calls"][0]["function"] == {
        "name": "search_flights",
        "arguments": '{"origin": "LHR"}',
    }
    tool = _conversation()[3].to_openai()
    assert tool == {"role": "tool", "content": '{"flights": []}', "tool_call_id": "call_1"}
    assert "metadata" not in _conversation()[1].to_openai()


def test_usage_adds_and_totals() -> None:
    total = Usage(prompt_tokens=10, completion_tokens=2) + Usage(prompt_tokens=5)
    assert total == Usage(prompt_tokens=15, completion_tokens=2)
    assert total.total_tokens == 17
    with pytest.raises(ValidationError):
        Usage(prompt_tokens=-1)


def test_tool_call_arguments_kept_raw() -> None:
    call = ToolCall(id="c", name="t", arguments="{'bad': json,}")
    assert call.arguments == "{'bad': json,}"
    with pytest.raises(ValueError):
        call.parsed_arguments()
