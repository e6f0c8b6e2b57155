"""The lingua franca every part of keel speaks: messages, tool calls and token usage.

They are frozen Pydantic v2 models, so a value read back from storage or a trace is equal to
the one written (``Message.model_validate_json(m.model_dump_json()) == m``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import compress, count
from operator import is_not
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Message", "Role", "ToolCall", "Usage"]

Role = Literal["system", "user", "assistant", "tool"]
"""Who a message is from: the chat roles every OpenAI-compatible provider understands."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ToolCall(BaseModel):
    """One call of a tool that a model asked for."""

    model_config = _FROZEN

    id: str = Field(min_length=1, description="Provider-assigned id that the tool result echoes.")
    name: str = Field(min_length=1, description="Name of the tool the model asked for.")
    arguments: str = Field(
        default="{}",
        description=(
            "Arguments exactly as the model produced them: a JSON text that may be invalid. "
            "Kept raw so that validation and repair can report what the model really sent."
        ),
    )

    def parsed_arguments(self) -> Any:
        """The arguments decoded from JSON; raises ``json.JSONDecodeError`` if they are not JSON."""
        return json.loads(self.arguments)


class Usage(BaseModel):
    """Tokens a model call consumed, as reported by the provider or counted exactly."""

    model_config = _FROZEN

    prompt_tokens: int = Field(default=0, ge=0, description="Tokens in the prompt sent.")
    completion_tokens: int = Field(default=0, ge=0, description="Tokens the model generated.")

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
        )


class Message(BaseModel):
    """One chat message.

    Tool results are ``role="tool"`` messages whose ``tool_call_id`` names the call they answer;
    an assistant message may carry ``tool_calls`` with or without text.
    """

    model_config = _FROZEN

    role: Role = Field(description="Who the message is from.")
    content: str = Field(default="", description="The text of the message; may be empty.")
    tool_calls: tuple[ToolCall, ...] = Field(
        default=(), description="Tool calls an assistant message asks for, in order."
    )
    tool_call_id: str | None = Field(
        default=None, description="For a tool message: the id of the call it answers."
    )
    name: str | None = Field(
        default=None,
        description="Optional author name (a user's handle, or the tool's name on a tool message).",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Free-form data for keel and the application (turn ids, timestamps). "
            "Never sent to a model."
        ),
    )

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id belongs on tool messages, not {self.role!r}")
        return self

    @classmethod
    def system(cls, content: str, **extra: Any) -> Message:
        """A system message."""
        return cls(role="system", content=content, **extra)

    @classmethod
    def user(cls, content: str, **extra: Any) -> Message:
        """A user message."""
        return cls(role="user", content=content, **extra)

    @classmethod
    def assistant(
        cls, content: str = "", tool_calls: list[ToolCall] | tuple[ToolCall, ...] = (), **extra: Any
    ) -> Message:
        """An assistant message, with optional tool calls."""
        return cls(role="assistant", content=content, tool_calls=tuple(tool_calls), **extra)

    @classmethod
    def tool(
        cls, tool_call_id: str, content: str, name: str | None = None, **extra: Any
    ) -> Message:
        """The result of the tool call ``tool_call_id``."""
        return cls(role="tool", content=content, tool_call_id=tool_call_id, name=name, **extra)

    def to_openai(self) -> dict[str, Any]:
        """This message in the OpenAI chat-completions wire format (metadata left out)."""
        wire: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            wire["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
            if not self.content:
                wire["content"] = None
        if self.tool_call_id is not None:
            wire["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role != "tool":
            wire["name"] = self.name
        return wire


def equal_run_length(
    messages: Sequence[Message], i: int, other: Sequence[Message], j: int, span: int
) -> int:
    """How many of ``messages`` from ``i`` on equal ``other``'s from ``j`` on (at most
    ``span``; the first pair is known to be the same object). Compared as lists, in C: a list
    comparison passes identical items without calling ``__eq__``, several times faster than an
    identity check per item. Where the whole span differs, the first pair that differs is the
    first pair of different objects (found in C too) that do not compare equal: one pass, not
    the halving this did before (two new slices of the span at each of its ~11 steps, for a
    prompt's window of a thousand messages). Shared by the token counter and the trace's
    prompt record, which both follow a list of messages against the one before it."""
    mine, theirs = messages[i : i + span], other[j : j + span]
    if mine == theirs:
        return span
    # A list comparison stops at the first pair that is neither one object nor equal: so
    # does this, looking at pairs of different objects only.
    for k in compress(count(), map(is_not, mine, theirs)):
        if mine[k] != theirs[k]:
            return k
    return min(len(mine), len(theirs))
