"""The service's request bodies (validated by FastAPI; 422 with every field's problem)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ErrorBody",
    "MemoryAddition",
    "Resolution",
    "RevertRequest",
    "TurnRequest",
]


MAX_MESSAGE_CHARS = 100_000
"""The most characters of one message, a turn's or a chat completion's, and of all the
messages of one chat completion request."""


class TurnRequest(BaseModel):
    """One user message for a session."""

    model_config = ConfigDict(extra="forbid")

    message: str = Field(
        min_length=1, max_length=MAX_MESSAGE_CHARS, description="What the user wrote."
    )
    user: str = Field(min_length=1, max_length=256, description="The user the session belongs to.")


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
    content: str = Field(min_length=1, max_length=10_000, description="What to tell the model.")


class MemoryAddition(BaseModel):
    """A note to remember for one user."""

    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1, max_length=20_000)
    kind: Literal["episodic", "semantic", "procedural"] = "semantic"


class ChatMessage(BaseModel):
    """One message of an OpenAI chat completion request (only what keel reads is checked)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def characters(self) -> int:
        """The length of the message's text (of its text parts)."""
        if isinstance(self.content, list):
            return sum(len(str(part.get("text", ""))) for part in self.content)
        return len(self.content or "")


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request; keel uses the newest user message."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _capped(self) -> ChatCompletionRequest:
        # The whole list's cap is each message's too.
        if sum(message.characters() for message in self.messages) > MAX_MESSAGE_CHARS:
            raise ValueError(f"the messages hold at most {MAX_MESSAGE_CHARS} characters in all")
        return self

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
