"""The model interface: one request shape, one answer shape, sync and async twins.

Providers subclass :class:`ChatModel` and implement ``_acomplete`` (and optionally
``_astream``); the sync methods run the async ones. Retries and fault translation live in the
provider layer, once, never in callers.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_sync
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
        """Sync twin of :meth:`acomplete` (not for use inside a running event loop)."""

        async def once() -> Completion:
            try:
                return await self.acomplete(messages, tools, options)
            finally:
                await self._release_loop_resources()

        # Its own short-lived loop, released after the call: a one-off call from sync code
        # leaves nothing open (an agent's sync twins run on keel's bridge loop instead).
        return asyncio.run(once())

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
        """Sync twin of :meth:`astream`: chunks arrive as they are generated.

        The async stream runs on its own event loop in a helper thread; leaving the loop early
        (``break``) stops it after the chunk in flight.
        """
        handoff: queue.Queue[CompletionChunk | BaseException | None] = queue.Queue(maxsize=64)
        stop = threading.Event()

        async def pump() -> None:
            try:
                async for chunk in self.astream(messages, tools, options):
                    while not stop.is_set():
                        try:
                            handoff.put(chunk, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            finally:
                await self._release_loop_resources()

        def run() -> None:
            try:
                asyncio.run(pump())
                handoff.put(None)
            except BaseException as exc:  # handed to the caller's thread, raised there
                handoff.put(exc)

        worker = threading.Thread(target=run, name="keel-model-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = handoff.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # A producer blocked on the full queue sees this within 0.1 s and ends its loop.
            stop.set()

    async def _release_loop_resources(self) -> None:  # noqa: B027  (optional hook)
        """Hook: release what belongs to the running event loop (the sync twins end it)."""

    async def aclose(self) -> None:  # noqa: B027  (optional hook)
        """Release connections or loaded weights."""

    def close(self) -> None:
        """Sync twin of :meth:`aclose`."""
        run_sync(self.aclose())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
