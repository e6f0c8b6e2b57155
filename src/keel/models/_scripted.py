"""A deterministic model for tests and demos: replies come from a list or a function.

Every call is recorded (messages, tools, options), so a test can assert exactly what the
runtime sent; ``keep_calls`` bounds that record to the newest calls for a long run. A scripted
reply may be text, a Message, a Completion, an exception to raise, or a function of the call
that returns any of those.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from keel.errors import UsageError
from keel.messages import Message, ToolCall, Usage
from keel.models._base import (
    ChatModel,
    Completion,
    CompletionChunk,
    ModelOptions,
    ToolCallDelta,
    ToolSchema,
)
from keel.tokens import ChatTokenCounter, counter_for

__all__ = ["ScriptedCall", "ScriptedModel", "ScriptedReply"]

_call_ids = itertools.count(1)


@dataclass(frozen=True)
class ScriptedCall:
    """What the scripted model received in one call."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSchema, ...]
    options: ModelOptions

    @property
    def last_user_text(self) -> str:
        """The text of the newest user message, or ''."""
        for message in reversed(self.messages):
            if message.role == "user":
                return message.content
        return ""


def _as_tuple(messages: Sequence[Message]) -> tuple[Message, ...]:
    return messages if type(messages) is tuple else tuple(messages)


ScriptedReply = (
    str | Message | Completion | BaseException | Callable[[ScriptedCall], "ScriptedReply"]
)


@dataclass
class _Script:
    replies: list[ScriptedReply] = field(default_factory=list)
    position: int = 0


class ScriptedModel(ChatModel):
    """Answers from a script instead of a network or weights.

    Args:
        replies: replies in order, or one function called for every request.
        model: whose window and tokenizer to report (default ``gpt-4o-mini``).
        delay_s: sleep this long per call (to exercise timeouts).
        repeat_last: when the list runs out, repeat its last reply instead of raising.
        stream_chunk_chars: streamed (``astream``), a text reply comes in pieces of this many
            characters, and each tool call's arguments in two pieces.
        stream_delay_s: sleep this long before each streamed piece.
        keep_calls: how many of the newest calls ``calls`` keeps (None, the default: every
            one). A long run (a benchmark's thousand turns, a server) keeps a few or none:
            each kept call holds the whole prompt it was sent, and a heap that only grows
            makes the garbage collector's full passes, which walk all of it, ever longer.
    """

    def __init__(
        self,
        replies: Iterable[ScriptedReply] | Callable[[ScriptedCall], ScriptedReply] = (),
        *,
        model: str = "gpt-4o-mini",
        delay_s: float = 0.0,
        repeat_last: bool = False,
        counter: ChatTokenCounter | None = None,
        stream_chunk_chars: int = 4,
        stream_delay_s: float = 0.0,
        keep_calls: int | None = None,
    ) -> None:
        if stream_chunk_chars < 1:
            raise UsageError(f"stream_chunk_chars must be >= 1, got {stream_chunk_chars}")
        if keep_calls is not None and keep_calls < 0:
            raise UsageError(f"keep_calls must be >= 0 or None, got {keep_calls}")
        counter = counter or counter_for(model, allow_estimate=True)
        super().__init__(f"scripted:{model}", counter.profile, counter)
        self._policy: Callable[[ScriptedCall], ScriptedReply] | None = None
        if callable(replies):
            self._policy = replies
            self._script = _Script()
        else:
            self._script = _Script(list(replies))
        self.delay_s = delay_s
        self.repeat_last = repeat_last
        self.calls: list[ScriptedCall] = []
        self.keep_calls = keep_calls
        self.stream_chunk_chars = stream_chunk_chars
        self.stream_delay_s = stream_delay_s

    async def acomplete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> Completion:
        """Answer from the script. A tuple of messages (a compiled prompt) is the call's
        record as it is: the prompt is not copied twice (into a list, then back)."""
        return await self._acomplete(_as_tuple(messages), list(tools), options or ModelOptions())

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> AsyncIterator[CompletionChunk]:
        """Stream the scripted answer (see `acomplete` for ``messages``)."""
        return self._astream(_as_tuple(messages), list(tools), options or ModelOptions())

    def _record(self, call: ScriptedCall) -> None:
        """Append ``call`` to ``calls``, dropping the oldest past ``keep_calls``."""
        calls, keep = self.calls, self.keep_calls
        if keep is None:
            calls.append(call)
        elif keep > 0:
            calls.append(call)
            if len(calls) > keep:
                del calls[: len(calls) - keep]

    def _next_reply(self, call: ScriptedCall) -> ScriptedReply:
        if self._policy is not None:
            return self._policy(call)
        script = self._script
        if script.position >= len(script.replies):
            if self.repeat_last and script.replies:
                return script.replies[-1]
            raise UsageError(f"scripted model ran out of replies after {script.position} calls")
        reply = script.replies[script.position]
        script.position += 1
        return reply

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        started = time.perf_counter()
        call = ScriptedCall(tuple(messages), tuple(tools), options)
        self._record(call)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self._next_reply(call)
        while callable(reply) and not isinstance(reply, BaseException):
            reply = reply(call)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, Completion):
            return reply
        message = Message.assistant(reply) if isinstance(reply, str) else reply
        usage = Usage(
            # The call's tuple: counted without another copy of the prompt.
            prompt_tokens=self.counter.count_prompt(call.messages, tools),
            completion_tokens=self.counter.count_message(message),
        )
        return Completion(
            message=message,
            finish_reason="tool_calls" if message.tool_calls else "stop",
            usage=usage,
            model=self.spec,
            latency_ms=(time.perf_counter() - started) * 1000,
            ttft_ms=(time.perf_counter() - started) * 1000,
        )

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        completion = await self._acomplete(messages, tools, options)
        text, size = completion.message.content, self.stream_chunk_chars
        for start in range(0, len(text), size):
            if self.stream_delay_s:
                await asyncio.sleep(self.stream_delay_s)
            yield CompletionChunk(text=text[start : start + size])
        for index, call in enumerate(completion.message.tool_calls):
            half = len(call.arguments) // 2
            yield CompletionChunk(
                tool_calls=(
                    ToolCallDelta(
                        index=index, id=call.id, name=call.name, arguments=call.arguments[:half]
                    ),
                )
            )
            yield CompletionChunk(
                tool_calls=(ToolCallDelta(index=index, arguments=call.arguments[half:]),)
            )
        yield CompletionChunk(completion=completion)

    @staticmethod
    def tool_call(name: str, arguments: str = "{}", call_id: str | None = None) -> Message:
        """An assistant message calling one tool; ids are ``call_1``, ``call_2``, ... by default."""
        return Message.assistant(
            "",
            tool_calls=[
                ToolCall(id=call_id or f"call_{next(_call_ids)}", name=name, arguments=arguments)
            ],
        )
