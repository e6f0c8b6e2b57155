"""The service's request bodies (validated by FastAPI; 422 with every field's problem)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.service._ids import Text, UserId

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ErrorBody",
    "MemoryAddition",
    "Resolution",
    "RevertRequest",
    "TurnRequest",
]


class TurnRequest(BaseModel):
    """One user message for a session."""

    model_config = ConfigDict(extra="forbid")

    message: Text = Field(min_length=1, max_length=100_000, description="What the user wrote.")
    user: UserId = Field(description="The user the session belongs to.")


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: dict[str, str]


class RevertRequest(BaseModel):
    """Which version to go back to, on which version the caller read."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="The version whose state becomes the newest.")
    expected_version: int = Field(ge=1, description="The session's version the caller read.")


class Resolution(BaseModel):
    """What an operator found an in-doubt call did."""

    model_config = ConfigDict(extra="forbid")

    ok: bool = Field(description="Whether the call took effect.")
    content: Text = Field(min_length=1, max_length=10_000, description="What to tell the model.")


class MemoryAddition(BaseModel):
    """A note to remember for one user."""

    model_config = ConfigDict(extra="forbid")

    user: UserId
    text: Text = Field(min_length=1, max_length=20_000)
    kind: Literal["episodic", "semantic", "procedural"] = "semantic"


class ChatMessage(BaseModel):
    """One message of an OpenAI chat completion request (only what keel reads is checked)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request; keel uses the newest user message."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None

    def newest_user_text(self) -> str | None:
        """The text of the newest user message with text, or None when there is none."""
        for message in reversed(self.messages):
            if message.role != "user":
                continue
            content = message.content
            if isinstance(content, list):
                content = "".join(
                    str(part.get("text", "")) for part in content if part.get("type") == "text"
                )
            if content:
                return content
        return None
