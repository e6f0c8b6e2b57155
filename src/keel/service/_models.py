"""The service's request bodies (validated by FastAPI; 422 with every field's problem)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from keel.service._ids import Text, UserId

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ErrorBody",
    "MemoryAddition",
    "Resolution",
    "RevertRequest",
    "StreamOptions",
    "TurnRequest",
]


MAX_MESSAGE_CHARS = 100_000
"""The most characters of one message, a turn's or a chat completion's, and of all the
messages of one chat completion request."""


class TurnRequest(BaseModel):
    """One user message for a session."""

    model_config = ConfigDict(extra="forbid")

    message: Text = Field(
        min_length=1, max_length=MAX_MESSAGE_CHARS, description="What the user wrote."
    )
    user: UserId | None = Field(
        default=None,
        description="The user the session belongs to (default: the user of a user's key; "
        "an operator key names one).",
    )


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

    def text(self) -> str:
        """The message's text (the text parts of a list of parts, joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(
                str(part.get("text", "")) for part in content if part.get("type") == "text"
            )
        return content or ""

    def characters(self) -> int:
        """The length of the message's text (of its text parts)."""
        if isinstance(self.content, list):
            return sum(len(str(part.get("text", ""))) for part in self.content)
        return len(self.content or "")


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = Field(default=False, description="End with a chunk of usage.")


# Parameters that change nothing keel answers: accepted, and left out.
_IGNORED = frozenset(
    {"store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
)
# Generation parameters keel has no option for: accepted only at OpenAI's default (a client
# library may send the default), otherwise a 400 naming them; never silently ignored.
_AT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "top_p": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "logprobs": (False,),
    "modalities": (["text"],),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
}
_CLIENT_TOOLS = "keel's agent runs its own tools; a client's tools are not supported"
_WHY_NOT = {
    "n": "keel answers one choice per request: n must be 1",
    "tools": _CLIENT_TOOLS,
    "tool_choice": _CLIENT_TOOLS,
    "functions": _CLIENT_TOOLS,
    "function_call": _CLIENT_TOOLS,
}


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request. keel keeps the conversation and answers the last
    message, the user's new one. ``max_tokens`` / ``max_completion_tokens``,
    ``temperature``, ``stop`` and ``seed`` are this turn's model options; a parameter keel
    cannot honour is refused (`unsupported`), never ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _capped(self) -> ChatCompletionRequest:
        # The whole list's cap is each message's too.
        if sum(message.characters() for message in self.messages) > MAX_MESSAGE_CHARS:
            raise ValueError(f"the messages hold at most {MAX_MESSAGE_CHARS} characters in all")
        return self

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def unsupported(self) -> tuple[str, str] | None:
        """The first parameter keel cannot honour, and why; None when there is none."""
        both = self.max_tokens and self.max_completion_tokens
        if both and self.max_tokens != self.max_completion_tokens:
            return "max_tokens", "send max_completion_tokens or max_tokens, not both"
        for name, value in (self.model_extra or {}).items():
            if name in _IGNORED or value is None or value in _AT_DEFAULT_ONLY.get(name, ()):
                continue
            why = _WHY_NOT.get(name) or f"keel's chat completions do not support {name!r}"
            return name, why
        return None

    def model_options(self) -> dict[str, Any]:
        """The turn's model options the request sets (``ModelOptions`` fields)."""
        options: dict[str, Any] = {}
        tokens = self.max_completion_tokens or self.max_tokens
        if tokens is not None:
            # OpenAI's max_tokens caps the whole answer: a cut one is finish_reason "length",
            # not continued by the runtime.
            options["max_tokens"] = tokens
            options["continue_truncated"] = False
        if self.temperature is not None:
            options["temperature"] = self.temperature
        if self.stop:
            options["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.seed is not None:
            options["seed"] = self.seed
        return options
