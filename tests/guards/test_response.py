"""Response validation: cut-off and empty replies, structured outputs."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from keel.errors import MalformedResponseError, TruncatedResponseError
from keel.guards import check_response, validate_structured
from keel.messages import Message, ToolCall, Usage
from keel.models import Completion


def _reply(text: str = "", finish: str = "stop", calls: tuple[ToolCall, ...] = ()) -> Completion:
    return Completion(
        message=Message.assistant(text, tool_calls=calls),
        finish_reason=finish,  # type: ignore[arg-type]
        usage=Usage(),
        model="m",
        latency_ms=0,
    )


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (_reply("All good.", finish="length"), "finish_reason=length"),
        (_reply("Here:\n```python\nprint(1)"), "code block"),
        (_reply('{"answer": "yes", "items": [1, 2'), "JSON object"),
        (_reply("The cheapest flight leaves at noon and"), "mid-sentence"),
        (_reply("Your options are:"), "mid-sentence"),
        (
            _reply(calls=(ToolCall(id="c", name="book", arguments='{"flight": "AF'),)),
            "unclosed JSON",
        ),
    ],
)
def test_truncation_is_detected(reply: Completion, detail: str) -> None:
    problem = check_response(reply)
    assert problem is not None and problem.kind == "truncated"
    assert detail in problem.detail
    assert isinstance(problem.error("m"), TruncatedResponseError)
    assert "cut off" in problem.correction()


def test_empty_reply_is_detected() -> None:
    problem = check_response(_reply("   "))
    assert problem is not None and problem.kind == "empty"
    error = problem.error()
    assert isinstance(error, MalformedResponseError)
    assert not isinstance(error, TruncatedResponseError)


@pytest.mark.parametrize(
    "reply",
    [
        _reply("Booked AF1 for two."),
        _reply("```python\nprint(1)\n```"),
        _reply('{"answer": "yes"}'),
        _reply("See you soon :-)"),
        _reply("You are in seat 12A"),
        _reply("We will go with plan A"),
        _reply(calls=(ToolCall(id="c", name="book", arguments='{"flight": "AF1"}'),)),
        _reply("Let me check that", calls=(ToolCall(id="c", name="book", arguments="{}"),)),
    ],
)
def test_good_replies_pass(reply: Completion) -> None:
    assert check_response(reply) is None


class Answer(BaseModel):
    flight: str
    seats: int


def test_structured_output_validation() -> None:
    ok = validate_structured('```json\n{"flight": "AF1", "seats": "2"}\n```', Answer)
    assert ok.ok and ok.value == Answer(flight="AF1", seats=2)
    assert ok.repairs == ("removed a markdown code fence",)
    bad = validate_structured('{"flight": "AF1", "seats": "many"}', Answer)
    assert not bad.ok and bad.problems == ("Field 'seats': Input should be a valid integer",)
    assert '"seats"' in bad.correction(Answer) and "only one JSON object" in bad.correction(Answer)
    prose = validate_structured("AF1, two seats", Answer)
    assert not prose.ok and "not valid JSON" in prose.problems[0]
