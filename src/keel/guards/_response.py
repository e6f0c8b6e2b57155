"""Response validation: cut-off and empty replies, and structured outputs against a schema."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import TypeAdapter, ValidationError

from keel._model_json import ArgumentsNotJSONError, format_validation_error, parse_arguments
from keel.errors import MalformedResponseError, TruncatedResponseError
from keel.models import Completion

__all__ = [
    "ResponseProblem",
    "ResponseProblemKind",
    "StructuredOutcome",
    "check_response",
    "validate_structured",
]

ResponseProblemKind = Literal["truncated", "empty"]
"""``truncated``: the reply was cut off. ``empty``: no text and no tool call."""

T = TypeVar("T")

# A reply that ends on one of these was cut off mid-sentence.
_DANGLING_WORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "and",
        "or",
        "but",
        "of",
        "to",
        "with",
        "for",
        "from",
        "in",
        "on",
        "at",
        "by",
        "as",
        "is",
        "are",
        "was",
        "were",
        "that",
        "which",
        "because",
        "if",
        "then",
        "than",
    ]
)
_DANGLING_CHARS = (",", ":", ";", "(", "[", "{", "-", "/", "&", "=")


@dataclass(frozen=True)
class ResponseProblem:
    """Why a reply cannot be used as is."""

    kind: ResponseProblemKind
    detail: str

    def error(self, model: str = "") -> MalformedResponseError:
        """The typed error for this problem."""
        if self.kind == "truncated":
            return TruncatedResponseError(f"reply cut off: {self.detail}", model=model)
        return MalformedResponseError(f"unusable reply: {self.detail}", model=model)

    def correction(self) -> str:
        """What the model is told before it tries again."""
        if self.kind == "truncated":
            return (
                f"Your previous reply was cut off ({self.detail}). Answer again, shorter, and "
                "make sure every JSON object and code block is closed."
            )
        return "Your previous reply was empty. Answer the user, or call a tool."


def check_response(completion: Completion) -> ResponseProblem | None:
    """The problem with a reply, or None when it can be used.

    Detected: ``finish_reason == "length"``, tool-call arguments that are an unclosed JSON
    object, a reply that is (or ends inside) an unclosed JSON object or code block, text that
    stops on a dangling word or character, and replies with neither text nor tool calls.
    """
    message = completion.message
    text = message.content
    if completion.finish_reason == "length":
        return ResponseProblem("truncated", "the model hit its token limit (finish_reason=length)")
    for call in message.tool_calls:
        if _unclosed_json(call.arguments):
            return ResponseProblem(
                "truncated", f"the arguments of the {call.name!r} call are an unclosed JSON object"
            )
    if not text.strip() and not message.tool_calls:
        return ResponseProblem("empty", "the reply has no text and no tool call")
    if text.count("```") % 2 == 1:
        return ResponseProblem("truncated", "a code block is not closed")
    stripped = text.strip()
    if stripped.startswith(("{", "[")) and _unclosed_json(stripped):
        return ResponseProblem("truncated", "the JSON object is not closed")
    if stripped and not message.tool_calls and _dangling(stripped):
        return ResponseProblem("truncated", "the text stops mid-sentence")
    return None


def _unclosed_json(text: str) -> bool:
    text = text.strip()
    if not text.startswith(("{", "[")):
        return False
    depth = 0
    quote = False
    escaped = False
    for char in text:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quote = False
            continue
        if char == '"':
            quote = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return depth > 0 or quote


def _dangling(text: str) -> bool:
    if text.endswith(_DANGLING_CHARS) and not text.endswith((":-)", ";-)")):
        return True
    # Lowercase whole words only: "seat 12A" or "plan A" end a sentence well enough.
    last = re.search(r"(?:^|\s)([a-z']+)$", text)
    return last is not None and last.group(1) in _DANGLING_WORDS


@dataclass(frozen=True)
class StructuredOutcome(Generic[T]):
    """A structured answer checked against its schema: the value, or the problems."""

    value: T | None
    problems: tuple[str, ...]
    repairs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the answer validated."""
        return self.value is not None

    def correction(self, schema: type[Any]) -> str:
        """The corrective message for a retry: each problem, then the schema."""
        return (
            "Your answer does not match the required JSON schema:\n"
            + "\n".join(self.problems)
            + "\nReply again with only one JSON object that follows this schema:\n"
            + json.dumps(output_json_schema(schema), ensure_ascii=False)
        )


_adapters: dict[Any, TypeAdapter[Any]] = {}


def _adapter(schema: type[Any]) -> TypeAdapter[Any]:
    """One adapter per output type (building one compiles a validator)."""
    adapter = _adapters.get(schema)
    if adapter is None:
        if len(_adapters) >= 64:
            _adapters.clear()
        adapter = _adapters[schema] = TypeAdapter(schema)
    return adapter


def output_json_schema(schema: type[Any]) -> dict[str, Any]:
    """The JSON schema of an output type (a Pydantic model, a TypedDict, a dataclass...)."""
    return _adapter(schema).json_schema()


def validate_structured(text: str, schema: type[T]) -> StructuredOutcome[T]:
    """Parse ``text`` as one JSON object (safe repairs allowed) and validate it against
    ``schema``: a Pydantic model, a TypedDict, a dataclass, any type Pydantic validates."""
    try:
        parsed = parse_arguments(text)
    except ArgumentsNotJSONError as exc:
        reason = str(exc).replace("arguments", "the answer", 1)
        return StructuredOutcome(None, (reason,))
    try:
        value = _adapter(schema).validate_python(parsed.value)
    except ValidationError as exc:
        return StructuredOutcome(None, tuple(format_validation_error(exc)), parsed.repairs)
    return StructuredOutcome(value, (), parsed.repairs)
