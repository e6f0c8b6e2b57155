"""The OpenAI-compatible provider over real HTTP against llama-cpp-python's own server."""

from __future__ import annotations

import pytest

from keel.messages import Message
from keel.models import ModelOptions, OpenAICompatibleModel, resolve_model
from keel.tokens import counter_for

pytestmark = pytest.mark.slow

PROMPT = [Message.user("What is the capital of France?")]
OPTIONS = ModelOptions(max_tokens=16, temperature=0, allow_truncated=True)


async def test_plain_and_streamed_completion_with_exact_usage(llama_server_url: str) -> None:
    model = resolve_model(f"openai-compatible:smollm2@{llama_server_url}")
    assert isinstance(model, OpenAICompatibleModel)
    try:
        plain = await model.acomplete(PROMPT, options=OPTIONS)
        chunks = [chunk async for chunk in model.astream(PROMPT, options=OPTIONS)]
    finally:
        await model.aclose()

    assert plain.text.strip()
    assert plain.finish_reason in ("stop", "length")
    assert plain.attempts == 1 and plain.latency_ms > 0
    assert plain.raw["choices"][0]["message"]["content"] == plain.text
    # The server's own count equals keel's offline count of the same prompt.
    counter = counter_for("local:smollm2")
    assert plain.usage.prompt_tokens == counter.count_prompt(PROMPT)
    assert 0 < plain.usage.completion_tokens <= 16

    streamed = chunks[-1].completion
    assert streamed is not None
    pieces = [chunk.text for chunk in chunks[:-1] if chunk.text]
    assert len(pieces) >= 2  # really streamed, piece by piece
    assert "".join(pieces) == streamed.text == plain.text  # temperature 0: the same answer
    assert streamed.ttft_ms is not None and 0 < streamed.ttft_ms <= streamed.latency_ms
    assert streamed.raw["streamed"] is True
    # llama.cpp's server sends no usage in a stream: keel counts it, and gets the server's
    # own figures for the same answer.
    assert streamed.usage == plain.usage
