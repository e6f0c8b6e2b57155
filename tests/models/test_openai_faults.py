"""The OpenAI-compatible provider against a real local server that fails on purpose."""

from __future__ import annotations

import time

import openai
import pytest

from keel.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    ModelTimeoutError,
    ModelUnavailableError,
    RateLimitError,
    TruncatedResponseError,
)
from keel.messages import Message
from keel.models import Completion, ModelOptions, OpenAICompatibleModel, RetryPolicy
from keel.testing import FaultServer

HI = [Message.user("hi")]


def model_for(server: FaultServer, scenario: str, retry: RetryPolicy) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(scenario, base_url=server.base_url, api_key="x", retry=retry)


async def run(model: OpenAICompatibleModel, *, stream: bool, **options: object) -> Completion:
    opts = ModelOptions.model_validate(options)
    try:
        if not stream:
            return await model.acomplete(HI, options=opts)
        chunks = [chunk async for chunk in model.astream(HI, options=opts)]
        assert chunks[-1].completion is not None
        return chunks[-1].completion
    finally:
        await model.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_ok(fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool) -> None:
    completion = await run(model_for(fault_server, "ok", fast_retry), stream=stream)
    assert completion.text == "Hello from the fault server."
    assert completion.finish_reason == "stop" and completion.attempts == 1
    assert completion.usage.prompt_tokens == 11 and completion.usage.completion_tokens == 7


@pytest.mark.parametrize("stream", [False, True])
async def test_429_with_retry_after_is_honoured_then_succeeds(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    started = time.monotonic()
    completion = await run(model_for(fault_server, "rate_limit:2", fast_retry), stream=stream)
    elapsed = time.monotonic() - started
    assert completion.attempts == 3
    assert fault_server.count("rate_limit:2") == 3
    # Two waits of Retry-After (0.2 s), not the policy's shorter backoff.
    assert 0.38 <= elapsed < 5


async def test_429_forever_ends_in_rate_limit_error(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    with pytest.raises(RateLimitError) as caught:
        await run(model_for(fault_server, "rate_limit", fast_retry), stream=False)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, openai.RateLimitError)
    assert fault_server.count("rate_limit") == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_500_then_success(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    completion = await run(model_for(fault_server, "server_error:1", fast_retry), stream=stream)
    assert completion.attempts == 2 and completion.text == "Hello from the fault server."


async def test_500_forever_ends_in_unavailable(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    with pytest.raises(ModelUnavailableError) as caught:
        await run(model_for(fault_server, "server_error", fast_retry), stream=True)
    assert caught.value.attempts == 3
    assert "HTTP 500" in str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_past_the_timeout(
    fault_server: FaultServer, hang_retry: RetryPolicy, stream: bool
) -> None:
    started = time.monotonic()
    with pytest.raises(ModelTimeoutError) as caught:
        await run(model_for(fault_server, "hang", hang_retry), stream=stream)
    elapsed = time.monotonic() - started
    assert caught.value.attempts == 3
    assert 1.5 <= elapsed < 5  # three 0.5 s attempts and two short waits


async def test_call_timeout_caps_retries_in_total(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    started = time.monotonic()
    with pytest.raises(ModelTimeoutError):
        await run(model_for(fault_server, "hang", fast_retry), stream=False, timeout_s=0.3)
    assert time.monotonic() - started < 1.5
    assert fault_server.count("hang") == 1


async def test_stream_cut_midway_is_truncated_not_retried(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    model = model_for(fault_server, "cut_stream", fast_retry)
    texts: list[str] = []
    with pytest.raises(TruncatedResponseError) as caught:
        async for chunk in model.astream(HI):
            texts.append(chunk.text)
    await model.aclose()
    assert "".join(texts).startswith("Hello")  # the caller saw the start, then a typed error
    assert "broke after" in str(caught.value)
    assert fault_server.count("cut_stream") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_cut_before_any_chunk_is_retried(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    completion = await run(model_for(fault_server, "cut_early:1", fast_retry), stream=stream)
    assert completion.attempts == 2
    assert completion.text == "Hello from the fault server."


async def test_body_cut_without_streaming_is_retried_then_unavailable(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    with pytest.raises(ModelUnavailableError) as caught:
        await run(model_for(fault_server, "cut_stream", fast_retry), stream=False)
    assert caught.value.attempts == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_tool_arguments(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    with pytest.raises(MalformedResponseError) as caught:
        await run(model_for(fault_server, "malformed_tool_args", fast_retry), stream=stream)
    assert not isinstance(caught.value, TruncatedResponseError)
    partial = caught.value.raw
    assert isinstance(partial, Completion)
    assert partial.message.tool_calls[0].arguments == '{"city": "Par'
    assert caught.value.attempts == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_finish_reason_length(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    with pytest.raises(TruncatedResponseError) as caught:
        await run(model_for(fault_server, "length", fast_retry), stream=stream)
    assert isinstance(caught.value.raw, Completion) and caught.value.raw.truncated
    allowed = await run(
        model_for(fault_server, "length", fast_retry), stream=stream, allow_truncated=True
    )
    assert allowed.truncated and allowed.text.startswith("Hello from the fault ser")


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded_is_typed_and_not_retried(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    with pytest.raises(ContextLengthExceededError) as caught:
        await run(model_for(fault_server, "context_length", fast_retry), stream=stream)
    assert isinstance(caught.value, BadRequestError)
    assert caught.value.attempts == 1
    assert fault_server.count("context_length") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_401_is_not_retried(
    fault_server: FaultServer, fast_retry: RetryPolicy, stream: bool
) -> None:
    with pytest.raises(AuthenticationError) as caught:
        await run(model_for(fault_server, "unauthorized", fast_retry), stream=stream)
    assert caught.value.attempts == 1
    assert isinstance(caught.value.__cause__, openai.AuthenticationError)


async def test_connection_refused_is_retried_then_unavailable(fast_retry: RetryPolicy) -> None:
    from keel.testing.servers import free_port

    model = OpenAICompatibleModel(
        "ok", base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="x", retry=fast_retry
    )
    with pytest.raises(ModelUnavailableError) as caught:
        await run(model, stream=False)
    assert caught.value.attempts == 3


def test_sync_twins_work_across_event_loops(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    model = model_for(fault_server, "ok", fast_retry)
    first = model.complete(HI)
    second = model.complete(HI)  # a new event loop: the model must not reuse a dead client
    chunks = list(model.stream(HI))
    assert first.text == second.text == "Hello from the fault server."
    assert "".join(chunk.text for chunk in chunks) == first.text
    assert chunks[-1].completion is not None


def test_request_carries_options(fault_server: FaultServer, fast_retry: RetryPolicy) -> None:
    model = model_for(fault_server, "ok", fast_retry)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    options = ModelOptions(
        max_tokens=12, temperature=0.2, stop=("END",), seed=3, json_mode=True, tool_choice="auto"
    )
    model.complete(HI, tools, options)
    body = fault_server.requests[-1].body
    assert body["max_tokens"] == 12 and body["temperature"] == 0.2 and body["seed"] == 3
    assert body["stop"] == ["END"] and body["tool_choice"] == "auto"
    assert body["response_format"] == {"type": "json_object"}
    assert body["tools"][0]["function"]["name"] == "f"
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_sync_stream_is_live_and_can_stop_early(
    fault_server: FaultServer, fast_retry: RetryPolicy
) -> None:
    model = model_for(fault_server, "ok", fast_retry)
    first = None
    for chunk in model.stream(HI):
        first = chunk
        break
    assert first is not None and first.text == "Hello " and first.completion is None
    with pytest.raises(TruncatedResponseError):  # errors cross the thread, typed
        list(model_for(fault_server, "cut_stream", fast_retry).stream(HI))
