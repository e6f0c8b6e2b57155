"""The model interface: one request shape, one answer shape, sync and async twins.

Providers subclass [`ChatModel`][] and implement ``_acomplete`` (and optionally
``_astream``); the sync methods run the async ones. Retries and fault translation live in the
provider layer, once, never in callers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import iterate_sync, run_sync
from keel.messages import Message, Usage
from keel.models._toolcalls import ToolCallParseError
from keel.tokens import ChatTokenCounter, ModelProfile

__all__ = [
    "ChatModel",
    "Completion",
    "CompletionChunk",
    "FinishReason",
    "ModelOptions",
    "ToolCallDelta",
    "ToolSchema",
]

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "error"]
"""Why generation ended, normalized across providers."""

ToolSchema = Mapping[str, Any]
"""A tool in the OpenAI ``tools`` format: ``{"type": "function", "function": {...}}``."""


class ModelOptions(BaseModel):
    """Per-call generation options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, gt=0, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Sampling.")
    stop: tuple[str, ...] = Field(default=(), description="Stop sequences.")
    json_mode: bool = Field(default=False, description="Ask for a JSON object as the answer.")
    json_schema: dict[str, Any] | None = Field(
        default=None, description="A JSON schema the answer must follow (structured output)."
    )
    timeout_s: float | None = Field(
        default=None, gt=0, description="Wall-clock limit for the whole call, retries included."
    )
    tool_choice: Literal["auto", "none", "required"] | None = Field(
        default=None, description="Whether the model may, must or must not call tools."
    )
    seed: int | None = Field(default=None, description="Sampling seed where supported.")
    allow_truncated: bool = Field(
        default=False,
        description=(
            "Return an answer cut by max_tokens (finish_reason='length') instead of raising "
            "TruncatedResponseError. Off by default: a cut answer is never mistaken for a whole."
        ),
    )
    continue_truncated: bool = Field(
        default=True,
        description=(
            "For an agent's turn: an answer cut at max_tokens is continued by the runtime (the "
            "default), or, False, ends the turn cut (``reply.truncated``): the caller's "
            "max_tokens caps the whole answer, as OpenAI's API means it. Providers ignore it."
        ),
    )


class Completion(BaseModel):
    """A finished model answer."""

    model_config = ConfigDict(frozen=True)

    message: Message = Field(description="The assistant message: text and/or tool calls.")
    finish_reason: FinishReason = Field(description="Why generation ended.")
    usage: Usage = Field(description="Prompt and completion tokens.")
    model: str = Field(description="The model that answered (as the provider names it).")
    latency_ms: float = Field(ge=0, description="Wall time of the call, retries included.")
    ttft_ms: float | None = Field(
        default=None, ge=0, description="Time to the first token, when streamed."
    )
    attempts: int = Field(default=1, ge=1, description="Requests made, retries included.")
    raw: Any = Field(default=None, description="The provider's raw response, for traces.")
    tool_call_errors: tuple[ToolCallParseError, ...] = Field(
        default=(),
        description=(
            "Tool-call attempts in the text that could not be read (models without native tool "
            "calling); each has feedback to send back to the model."
        ),
    )

    @property
    def text(self) -> str:
        """The answer text (may be empty when the model only called tools)."""
        return self.message.content

    @property
    def truncated(self) -> bool:
        """Whether generation stopped at max_tokens (only returned with allow_truncated)."""
        return self.finish_reason == "length"


class ToolCallDelta(BaseModel):
    """An incremental piece of a streamed tool call."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0, description="Which call in the message this piece belongs to.")
    id: str | None = Field(default=None, description="The call id, on its first piece.")
    name: str | None = Field(default=None, description="The tool name, on its first piece.")
    arguments: str = Field(default="", description="More characters of the arguments JSON.")


class CompletionChunk(BaseModel):
    """One streamed increment. The last chunk carries ``completion``, the assembled answer."""

    model_config = ConfigDict(frozen=True)

    text: str = Field(default="", description="More characters of the answer text.")
    tool_calls: tuple[ToolCallDelta, ...] = Field(default=(), description="Tool-call pieces.")
    completion: Completion | None = Field(
        default=None, description="Set on the final chunk only: the complete, checked answer."
    )


class ChatModel(ABC):
    """A chat model. Implement ``_acomplete``; streaming defaults to one final chunk."""

    max_answer_tokens: int | None = None
    """The most tokens this model writes in one answer, whatever a call's ``max_tokens`` asks
    (None: no cap of its own). An agent's answer cut there ends as written, reported cut
    (``reply.truncated``): it is not continued, since the model was configured to stop there."""

    endpoint: str | None = None
    """The server this model calls, as configured (``http://host:port/v1``; None: none, or the
    provider's own). keel's errors about it name it, and it is never masked there: it is the
    deployment's configuration, not anyone's data, and an operator must see which server
    could not be reached."""

    def __init__(self, spec: str, profile: ModelProfile, counter: ChatTokenCounter) -> None:
        self.spec = spec
        self.profile = profile
        self.counter = counter

    @property
    def context_window(self) -> int:
        """Tokens the model accepts, prompt plus answer."""
        return self.profile.context_window

    @abstractmethod
    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        """Provider hook: one complete answer (retries included)."""

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        completion = await self._acomplete(messages, tools, options)
        yield CompletionChunk(text=completion.message.content, completion=completion)

    async def acomplete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> Completion:
        """Ask the model for one answer."""
        return await self._acomplete(list(messages), list(tools), options or ModelOptions())

    def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> Completion:
        """Sync twin of [`acomplete`][] (not for use inside a running event loop): runs on
        keel's bridge loop, where the model's HTTP client is made once and reused."""
        return run_sync(self.acomplete(messages, tools, options))

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> AsyncIterator[CompletionChunk]:
        """Stream the answer: text and tool-call deltas, then a final chunk with the whole."""
        return self._astream(list(messages), list(tools), options or ModelOptions())

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> Iterator[CompletionChunk]:
        """Sync twin of [`astream`][]: chunks arrive as they are generated.

        The async stream runs on keel's bridge loop; leaving the loop early (``break``) stops
        it where it waits.
        """
        return iterate_sync(self.astream(messages, tools, options))

    async def aclose(self) -> None:  # noqa: B027  (optional hook)
        """Release connections or loaded weights."""

    def close(self) -> None:
        """Sync twin of [`aclose`][]."""
        run_sync(self.aclose())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
