"""A fake model for the OpenAI Agents SDK and the checks run on what it received (the tests and
``keel bench integrations`` share them). Needs the ``openai-agents`` extra."""

from __future__ import annotations

import json
from typing import Any

from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from keel.tokens import ChatTokenCounter

__all__ = ["LooksUpThenAnswers", "orphaned_outputs", "text_tokens"]


class LooksUpThenAnswers(Model):
    """Calls ``lookup`` once per user message, then answers ``answer``; every input it was
    sent is kept in ``inputs``, in order."""

    def __init__(self, answer: str = "Found it.") -> None:
        self.answer = answer
        self.inputs: list[list[dict[str, Any]]] = []

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
    ) -> ModelResponse:
        items = [dict(item) for item in input] if isinstance(input, list) else []
        self.inputs.append(items)
        last = items[-1] if items else {}
        n = len(self.inputs)
        output: Any
        if last.get("type") == "function_call_output":
            text = ResponseOutputText(type="output_text", text=self.answer, annotations=[])
            output = ResponseOutputMessage(
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


def orphaned_outputs(items: list[dict[str, Any]]) -> list[str]:
    """The call ids of ``function_call_output`` items sent without their ``function_call``."""
    called = {item.get("call_id") for item in items if item.get("type") == "function_call"}
    return [
        str(item.get("call_id"))
        for item in items
        if item.get("type") == "function_call_output" and item.get("call_id") not in called
    ]


def text_tokens(items: list[dict[str, Any]], counter: ChatTokenCounter) -> int:
    """The tokens of the text the model reads in ``items`` (contents, outputs, arguments)."""
    parts = []
    for item in items:
        for key in ("content", "output", "arguments"):
            value = item.get(key)
            if isinstance(value, list):  # content parts: the model reads their text
                value = "".join(str(part.get("text", "")) for part in value)
            if value is not None:
                parts.append(value if isinstance(value, str) else json.dumps(value))
    return int(counter.count_text("\n".join(parts)))
