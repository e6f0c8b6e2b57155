"""OpenAI-compatible chat models over HTTP, through the official ``openai`` SDK.

One class serves OpenAI, Azure OpenAI (pass an ``AsyncAzureOpenAI`` client), vLLM, Ollama,
llama.cpp's server and LM Studio. The SDK is built with ``max_retries=0``: retries happen once,
in `keel.models._retry`, and every SDK or transport exception is translated into the
[`keel.errors`][] hierarchy with ``raise ... from exc``.

What is checked before an answer is returned:

* ``finish_reason == "length"`` raises [`TruncatedResponseError`][] (its
  ``raw`` is the partial [`Completion`][]), unless the call set ``allow_truncated``;
* tool-call arguments that are not valid JSON raise [`MalformedResponseError`][]
  (``raw`` is the unchecked [`Completion`][], for repair or feedback);
* a stream that ends without a finish reason, or breaks, raises ``TruncatedResponseError``;
* usage comes from the provider (``stream_options.include_usage`` when streaming) and is
  counted with the model's tokenizer when the provider sends none.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import json
import re
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keel._urls import redact_url
from keel.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    ModelError,
    ModelTimeoutError,
    ModelUnavailableError,
    RateLimitError,
    TruncatedResponseError,
)
from keel.messages import Message, ToolCall, Usage
from keel.models._answer import StreamedAnswer, refuse_cut_answer
from keel.models._base import (
    ChatModel,
    Completion,
    CompletionChunk,
    FinishReason,
    ModelOptions,
    ToolCallDelta,
    ToolSchema,
)
from keel.models._retry import RetryableModelError, RetryPolicy, RetryState, call_with_retries
from keel.tokens import ChatTokenCounter, counter_for

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["OpenAICompatibleModel", "is_context_length_error"]

_CONTEXT_PATTERNS = re.compile(
    r"context[ _-]?(length|window)|maximum context|too many tokens|prompt is too long|"
    r"exceeds? the (model'?s? )?(context|maximum)|input is too long|reduce the length",
    re.IGNORECASE,
)
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}


def is_context_length_error(code: str | None, message: str) -> bool:
    """Whether a provider's 400 means the prompt is longer than the model accepts."""
    if code in ("context_length_exceeded", "string_above_max_length"):
        return True
    return bool(_CONTEXT_PATTERNS.search(message or ""))


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds from ``retry-after-ms`` or ``retry-after`` (seconds or an HTTP date)."""
    if not headers:
        return None
    milliseconds = headers.get("retry-after-ms")
    if milliseconds:
        try:
            return max(0.0, float(milliseconds) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parsed = email.utils.parsedate_to_datetime(value) if value else None
    if parsed is None:
        return None
    return max(0.0, parsed.timestamp() - time.time())


def _with_cause(error: ModelError, cause: BaseException) -> ModelError:
    error.__cause__ = cause
    return error


def _delta_of(delta: Any) -> tuple[str, tuple[ToolCallDelta, ...]]:
    """A wire chunk's delta as keel's: its text and its tool-call pieces."""
    if delta is None:
        return "", ()
    pieces = tuple(
        ToolCallDelta(
            index=call.index,
            id=call.id,
            name=call.function.name if call.function else None,
            arguments=(call.function.arguments or "") if call.function else "",
        )
        for call in delta.tool_calls or ()
    )
    return delta.content or "", pieces


async def _close_quietly(stream: Any) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        # Closing a broken stream may fail again; the first failure is what matters.
        with contextlib.suppress(Exception):
            await close()


class OpenAICompatibleModel(ChatModel):
    """A chat model behind an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        model: the model name the server expects (``gpt-4o-mini``, a vLLM/Ollama model id).
        base_url: the API root (``http://host:port/v1``); None means OpenAI itself.
        api_key: the key; None reads ``OPENAI_API_KEY`` (local servers accept any value).
        retry: the retry policy (default [`RetryPolicy`][]).
        client: a ready ``AsyncOpenAI`` or ``AsyncAzureOpenAI`` client to use instead of
            building one; it should have ``max_retries=0`` so retries are not doubled.
        spec: the spec string to report (default ``openai-compatible:MODEL@URL``).
        counter: token counter; default from the model name (padded estimate if unknown).
        max_tokens_param: ``max_tokens`` (most servers) or ``max_completion_tokens`` (OpenAI's
            reasoning models reject the older name).
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        client: AsyncOpenAI | None = None,
        spec: str | None = None,
        counter: ChatTokenCounter | None = None,
        max_tokens_param: str = "max_tokens",
        default_headers: Mapping[str, str] | None = None,
    ) -> None:
        counter = counter or counter_for(model, allow_estimate=True)
        # The spec and the endpoint name the model in errors, traces and logs: a password in
        # the URL's user info stays in base_url, for the client alone.
        super().__init__(
            redact_url(
                spec or f"openai-compatible:{model}@{base_url or 'https://api.openai.com/v1'}"
            ),
            counter.profile,
            counter,
        )
        self.model = model
        self.base_url = base_url
        self.endpoint = None if base_url is None else redact_url(base_url)
        self.retry = retry or RetryPolicy()
        self.max_tokens_param = max_tokens_param
        self._api_key = api_key
        self._headers = dict(default_headers or {})
        self._client = client
        # An httpx client belongs to the event loop it first ran on (the sync twins' is keel's
        # bridge loop), so each loop gets its own client.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = (
            weakref.WeakKeyDictionary()
        )
        weakref.finalize(self, _close_dropped_clients, self._clients)

    # --- plumbing -----------------------------------------------------------------------------

    def _sdk_client(self) -> AsyncOpenAI:
        if self._client is not None:
            return self._client
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            from openai import AsyncOpenAI, OpenAIError

            try:
                client = AsyncOpenAI(
                    api_key=self._api_key,
                    base_url=self.base_url,
                    max_retries=0,
                    default_headers=self._headers or None,
                )
            except OpenAIError as exc:
                raise AuthenticationError(
                    f"cannot build the OpenAI client: {exc}", model=self.spec
                ) from exc
            self._clients[loop] = client
        return client

    def _request(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema],
        options: ModelOptions,
    ) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [message.to_openai() for message in messages],
        }
        if tools:
            # Sent even with tool_choice="none", so the prompt is the one that was counted.
            request["tools"] = [dict(tool) for tool in tools]
            if options.tool_choice:
                request["tool_choice"] = options.tool_choice
        if options.max_tokens is not None:
            request[self.max_tokens_param] = options.max_tokens
        if options.temperature is not None:
            request["temperature"] = options.temperature
        if options.stop:
            request["stop"] = list(options.stop)
        if options.seed is not None:
            request["seed"] = options.seed
        if options.json_schema is not None:
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": str(options.json_schema.get("title") or "answer"),
                    "schema": options.json_schema,
                },
            }
        elif options.json_mode:
            request["response_format"] = {"type": "json_object"}
        return request

    def _translate(self, exc: Exception) -> ModelError | RetryableModelError:
        """An SDK exception as a keel error; retryable ones come wrapped for the retry loop."""
        import openai

        model = self.spec
        if isinstance(exc, openai.APITimeoutError):
            return RetryableModelError(
                _with_cause(ModelTimeoutError(f"request timed out: {exc}", model=model), exc)
            )
        if isinstance(exc, openai.APIConnectionError):
            return RetryableModelError(
                _with_cause(
                    ModelUnavailableError(
                        f"cannot reach {self.endpoint or 'OpenAI'}: {exc}", model=model
                    ),
                    exc,
                )
            )
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            body = exc.body if isinstance(exc.body, dict) else {}
            detail = body.get("message") if isinstance(body.get("message"), str) else exc.message
            message = f"HTTP {status} from {self.endpoint or 'OpenAI'}: {detail}"
            after = _retry_after(exc.response.headers)
            if status in (401, 403):
                return _with_cause(AuthenticationError(message, model=model), exc)
            if status == 429:
                if exc.code == "insufficient_quota":
                    # Waiting does not add credit: say so at once.
                    return _with_cause(RateLimitError(message, model=model), exc)
                return RetryableModelError(
                    _with_cause(RateLimitError(message, model=model), exc), after
                )
            if status >= 500 or status in (408, 409):
                return RetryableModelError(
                    _with_cause(ModelUnavailableError(message, model=model), exc), after
                )
            if is_context_length_error(exc.code, str(detail)):
                return _with_cause(ContextLengthExceededError(message, model=model), exc)
            return _with_cause(BadRequestError(message, model=model), exc)
        if isinstance(exc, openai.APIResponseValidationError | json.JSONDecodeError):
            return _with_cause(
                MalformedResponseError(f"unreadable response: {exc}", model=model), exc
            )
        return _with_cause(ModelUnavailableError(f"{type(exc).__name__}: {exc}", model=model), exc)

    def _usage(
        self,
        reported: Any,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema],
        message: Message,
    ) -> Usage:
        if reported is not None and getattr(reported, "prompt_tokens", None) is not None:
            return Usage(
                prompt_tokens=int(reported.prompt_tokens or 0),
                completion_tokens=int(reported.completion_tokens or 0),
            )
        # The server sent no usage (many compatible servers do not stream it): count it.
        count = self.counter.count_text
        generated = count(message.content) + sum(
            count(call.name) + count(call.arguments) for call in message.tool_calls
        )
        return Usage(
            prompt_tokens=self.counter.count_prompt(messages, tools), completion_tokens=generated
        )

    def _check(self, completion: Completion, options: ModelOptions) -> Completion:
        for call in completion.message.tool_calls:
            try:
                json.loads(call.arguments or "{}")
            except json.JSONDecodeError as exc:
                cut = completion.finish_reason == "length"
                error_type = TruncatedResponseError if cut else MalformedResponseError
                raise error_type(
                    f"tool call {call.name!r} has arguments that are not valid JSON "
                    f"({exc.msg} at character {exc.pos}): {call.arguments[:200]!r}",
                    model=self.spec,
                    raw=completion,
                ) from exc
        generated = completion.usage.completion_tokens
        refuse_cut_answer(completion, options, self.spec, f"max_tokens after {generated} tokens")
        return completion

    # --- one answer ---------------------------------------------------------------------------

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        started = time.perf_counter()
        request = self._request(messages, tools, options)
        client = self._sdk_client()

        async def attempt(state: RetryState) -> Any:
            try:
                return await client.chat.completions.create(
                    **request, timeout=state.attempt_timeout()
                )
            except Exception as exc:
                translated = self._translate(exc)
                raise translated from exc

        response, state = await call_with_retries(
            attempt, self.retry, timeout_s=options.timeout_s, model=self.spec
        )
        if not getattr(response, "choices", None):
            raise MalformedResponseError(
                "the response has no choices", model=self.spec, raw=response
            )
        choice = response.choices[0]
        wire = choice.message
        calls = tuple(
            ToolCall(
                id=call.id or f"call_{index}",
                name=call.function.name,
                arguments=call.function.arguments or "{}",
            )
            for index, call in enumerate(wire.tool_calls or ())
            if getattr(call, "function", None) is not None
        )
        message = Message.assistant(wire.content or "", tool_calls=calls)
        finish = _FINISH.get(choice.finish_reason or "", "tool_calls" if calls else "stop")
        completion = Completion(
            message=message,
            finish_reason=finish,
            usage=self._usage(response.usage, messages, tools, message),
            model=response.model or self.model,
            latency_ms=(time.perf_counter() - started) * 1000,
            attempts=state.attempts,
            raw=response.model_dump(mode="json", exclude_unset=True),
        )
        return self._check(completion, options)

    # --- streaming ----------------------------------------------------------------------------

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        started = time.perf_counter()
        request = self._request(messages, tools, options)
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
        (stream, iterator, first), state = await call_with_retries(
            functools.partial(self._open_stream, self._sdk_client(), request),
            self.retry,
            timeout_s=options.timeout_s,
            model=self.spec,
        )
        answer = StreamedAnswer(started)
        finish: str | None = None
        usage: Any = None
        served_model = self.model
        chunks = 0
        try:
            async with contextlib.aclosing(self._chunks(iterator, first, state)) as incoming:
                async for chunk in incoming:
                    chunks += 1
                    served_model = getattr(chunk, "model", None) or served_model
                    if getattr(chunk, "usage", None) is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    if choice.finish_reason:
                        finish = choice.finish_reason
                    out = answer.add(*_delta_of(choice.delta))
                    if out is not None:
                        yield out
        finally:
            await _close_quietly(stream)
        if finish is None:
            raise TruncatedResponseError(
                f"the stream ended after {chunks} chunks without a finish reason",
                model=self.spec,
            )
        message = Message.assistant(answer.text, tool_calls=answer.tool_calls())
        completion = Completion(
            message=message,
            finish_reason=_FINISH.get(finish, "stop"),
            usage=self._usage(usage, messages, tools, message),
            model=served_model,
            latency_ms=(time.perf_counter() - started) * 1000,
            ttft_ms=answer.ttft_ms,
            attempts=state.attempts,
            raw={"streamed": True, "chunks": chunks, "finish_reason": finish},
        )
        yield CompletionChunk(completion=self._check(completion, options))

    async def _open_stream(
        self, client: AsyncOpenAI, request: dict[str, Any], state: RetryState
    ) -> tuple[Any, Any, Any]:
        """One attempt at opening the stream and reading its first chunk (None when it ended
        at once): the stream, its iterator and that chunk.

        Both are retried; once text reached the caller, a retry would show it twice, so later
        failures are final.
        """
        try:
            stream = await client.chat.completions.create(
                **request, timeout=state.attempt_timeout()
            )
        except Exception as exc:
            translated = self._translate(exc)
            raise translated from exc
        iterator = stream.__aiter__()
        try:
            first = await asyncio.wait_for(iterator.__anext__(), state.attempt_timeout())
        except StopAsyncIteration:
            return stream, iterator, None
        except Exception as exc:
            await _close_quietly(stream)
            if isinstance(exc, TimeoutError):
                error: ModelError = ModelTimeoutError(
                    "no first chunk within the attempt's timeout", model=self.spec
                )
                raise RetryableModelError(_with_cause(error, exc)) from exc
            translated = self._translate(exc)
            if isinstance(translated, ModelError) and not isinstance(
                translated, MalformedResponseError | BadRequestError | AuthenticationError
            ):
                translated = RetryableModelError(translated)
            raise translated from exc
        return stream, iterator, first

    async def _chunks(
        self, iterator: Any, first: Any, state: RetryState
    ) -> AsyncGenerator[Any, None]:
        """The stream's chunks from ``first`` on, each within the attempt's timeout and all
        within the call's time limit; a stall or a break is a truncated answer."""
        if first is None:
            return
        yield first
        read = 1
        while True:
            remaining = state.remaining()
            if remaining <= 0:
                raise ModelTimeoutError(
                    f"the stream did not finish within the call's time limit (after {read} chunks)",
                    model=self.spec,
                    attempts=state.attempts,
                )
            try:
                chunk = await asyncio.wait_for(
                    iterator.__anext__(), timeout=min(remaining, self.retry.attempt_timeout_s)
                )
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise TruncatedResponseError(
                    f"the stream stalled after {read} chunks", model=self.spec
                ) from exc
            except Exception as exc:
                raise TruncatedResponseError(
                    f"the stream broke after {read} chunks: {type(exc).__name__}: {exc}",
                    model=self.spec,
                ) from exc
            yield chunk
            read += 1

    async def aclose(self) -> None:
        """Close the HTTP clients this model opened (not one passed in), each on its own event
        loop (the sync twins' clients live on keel's bridge loop)."""
        running = asyncio.get_running_loop()
        for loop, client in list(self._clients.items()):
            if loop is running:
                await client.close()
            elif loop.is_running():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.close(), loop))
        self._clients.clear()


def _close_dropped_clients(
    clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI],
) -> None:
    """A model dropped without ``close()``: its clients' connections are closed on the loops
    they belong to (the bridge loop outlives every model), not left open for the garbage
    collector to find."""
    for loop, client in list(clients.items()):
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(client.close(), loop)
