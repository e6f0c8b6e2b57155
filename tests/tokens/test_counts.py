"""Exact token counts, pinned. A change in any number means the tokenizer changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from keel import Message, ToolCall
from keel.errors import UnknownModelError
from keel.tokens import ChatTokenCounter, count_tokens, counter_for, model_profile

SAMPLES = {
    "ascii": "Hello, world!",
    "sentence": "The quick brown fox jumps over the lazy dog.",
    "code": "def add(a: int, b: int) -> int:\n    return a + b\n",
    "json": '{"origin": "LHR", "destination": "JFK", "passengers": 2, "dates": ["2026-12-01"]}',
    "cjk": "你好，世界！今日は良い天気ですね。",
    "emoji": "Booked ✈️ 🎉👍🏽",
    "whitespace": "  leading and trailing  \n\n\ttabs",
}

PINNED = {
    "cl100k_base": {
        "ascii": 4,
        "sentence": 10,
        "code": 19,
        "json": 32,
        "cjk": 19,
        "emoji": 14,
        "whitespace": 7,
    },
    "gguf:smollm2": {
        "ascii": 4,
        "sentence": 10,
        "code": 20,
        "json": 38,
        "cjk": 33,
        "emoji": 15,
        "whitespace": 9,
    },
    "o200k_base": {
        "ascii": 4,
        "sentence": 10,
        "code": 19,
        "json": 33,
        "cjk": 11,
        "emoji": 9,
        "whitespace": 7,
    },
}


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("gpt-4o", "o200k_base"),
        ("local:smollm2", "gguf:smollm2"),
    ],
)
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_openai_counts_are_pinned(model: str, encoding: str, sample: str) -> None:
    result = count_tokens(SAMPLES[sample], model)
    assert result.exact
    assert result.encoding == encoding
    assert result.tokens == PINNED[encoding][sample]


def test_issue_example_hello_world_gpt4o() -> None:
    result = count_tokens("Hello, world!", "gpt-4o")
    assert result.model_dump() == {
        "model": "gpt-4o",
        "encoding": "o200k_base",
        "tokens": 4,
        "exact": True,
    }


@pytest.mark.parametrize(
    ("name", "encoding", "window"),
    [
        ("gpt-4o", "o200k_base", 128_000),
        ("gpt-4o-mini", "o200k_base", 128_000),
        ("gpt-4o-2024-08-06", "o200k_base", 128_000),
        ("openai:gpt-4.1-mini", "o200k_base", 1_047_576),
        ("o3-mini", "o200k_base", 200_000),
        ("o1", "o200k_base", 200_000),
        ("gpt-4", "cl100k_base", 8_192),
        ("gpt-4-turbo-2024-04-09", "cl100k_base", 128_000),
        ("gpt-35-turbo", "cl100k_base", 16_385),
        ("openai-compatible:gpt-4o@http://127.0.0.1:8000/v1", "o200k_base", 128_000),
        ("local:smollm2", "gguf:smollm2", 8_192),
    ],
)
def test_model_table(name: str, encoding: str, window: int) -> None:
    profile = model_profile(name)
    assert (profile.encoding, profile.context_window, profile.exact) == (encoding, window, True)


def test_unknown_model_is_an_error_unless_estimating() -> None:
    with pytest.raises(UnknownModelError, match="no-such-model"):
        count_tokens("hello", "no-such-model")
    with pytest.raises(UnknownModelError):
        model_profile("local:no-such-local")
    estimate = count_tokens(SAMPLES["sentence"], "no-such-model", allow_estimate=True)
    assert not estimate.exact
    # 10 exact o200k tokens padded by the 1.25 safety factor, rounded up.
    assert estimate.tokens == 13
    assert "estimate" in estimate.encoding


def test_openai_chat_overhead() -> None:
    counter = counter_for("gpt-4o")
    user = Message.user("Hello, world!")
    assert counter.count_message(user) == 4 + 3
    named = Message.user("Hello, world!", name="ada")
    assert counter.count_message(named) == 4 + 3 + 1 + counter.count_text("ada")
    # Two messages plus the 3 tokens that prime the reply.
    assert counter.count_messages([Message.system("Be brief."), user]) == (
        counter.count_text("Be brief.") + 3 + 7 + 3
    )
    call = ToolCall(id="c1", name="book", arguments='{"seat": "12A"}')
    with_call = Message.assistant("", tool_calls=[call])
    assert counter.count_message(with_call) > 3 + counter.count_text(call.arguments)


def test_tool_schemas_cost_tokens_and_grow_with_fields() -> None:
    counter = counter_for("gpt-4o")
    small = {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time.", "parameters": {}},
    }
    big = {
        "type": "function",
        "function": {
            "name": "book_flight",
            "description": "Book a flight.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "description": "IATA code"},
                    "passengers": {"type": "integer"},
                    "cabin": {"enum": ["economy", "business"]},
                },
                "required": ["origin"],
            },
        },
    }
    assert counter.count_tools([]) == 0
    assert 0 < counter.count_tools([small]) < counter.count_tools([big])
    assert counter.count_tools([small, big]) > counter.count_tools([big])
    prompt = [Message.user("hi")]
    assert counter.count_prompt(prompt, [big]) == counter.count_messages(prompt) + (
        counter.count_tools([big])
    )


def test_tool_schema_counts_follow_their_content_not_their_objects() -> None:
    counter = counter_for("gpt-4o")
    schema = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
    first = counter.count_tools([schema])
    assert counter.count_tools([copy.deepcopy(schema)]) == first
    # The same dict, changed in place: counted again, not read back from the cache.
    schema["function"]["description"] = "Look something up in the records of every customer."
    changed = counter.count_tools([schema])
    assert changed > first
    assert changed == counter_for("gpt-4o").count_tools([schema])


def test_chatml_framing_is_tokenized_exactly() -> None:
    counter = counter_for("local:smollm2")
    # <|im_start|> user \n Hello , world ! <|im_end|> \n
    assert counter.count_message(Message.user("Hello, world!")) == 9
    # Special-token spellings typed by a user are plain text, not control tokens.
    assert counter.count_text("<|im_start|>") > 1
    prompt = [Message.system("Be brief."), Message.user("Hello, world!")]
    # Both framed messages plus "<|im_start|>assistant\n" priming the reply.
    priming = counter.tokenizer.encode_template("<|im_start|>assistant\n")  # type: ignore[attr-defined]
    assert len(priming) == 4
    assert counter.count_messages(prompt) == (
        counter.count_message(prompt[0]) + counter.count_message(prompt[1]) + len(priming)
    )
    # Without a system message the template injects its default one, which costs tokens too.
    assert counter.count_messages([prompt[1]]) > counter.count_message(prompt[1]) + 3


def test_chatml_tool_calls_are_counted() -> None:
    counter = counter_for("local:smollm2")
    call = ToolCall(id="c1", name="book", arguments='{"seat": "12A"}')
    plain = Message.assistant("ok")
    with_call = Message.assistant("ok", tool_calls=[call])
    assert counter.count_message(with_call) > counter.count_message(plain) + 5


@pytest.mark.parametrize("model", ["gpt-4o-mini", "smollm2-135m"])
def test_a_prompt_partly_counted_before_costs_what_its_messages_cost(model: str) -> None:
    counter = counter_for(model, allow_estimate=True)
    seen = [Message.user(f"question {n} about item {n * 7}") for n in range(6)]
    counter.count_messages(seen[:4])  # the older messages are cached, the newer ones not
    prompt = [Message.system("You answer."), *seen, Message.assistant("an answer")]
    fresh = ChatTokenCounter(counter.profile, counter.tokenizer)
    expected = sum(fresh.count_message(m) for m in prompt) + (
        fresh.count_messages([prompt[0]]) - fresh.count_message(prompt[0])
    )
    assert counter.count_messages(prompt) == expected
    assert counter.count_messages(prompt) == expected  # now all cached


@pytest.mark.parametrize("model", ["gpt-4o-mini", "smollm2-135m"])
def test_successive_prompts_cost_what_their_messages_cost(model: str) -> None:
    counter = counter_for(model, allow_estimate=True)
    turns = [Message.user(f"question {n} " + "word " * n) for n in range(12)]
    system, rules = Message.system("You answer."), Message.system("Rules: be brief.")
    prompts = [
        [system, *turns[:8], rules],
        [system, *turns[:9], rules],  # one more turn, the rules after it
        [system, *turns[2:9], rules],  # the oldest turns left the window
        [system, turns[0], Message.user("changed in the middle"), *turns[2:4]],
        [system, *turns[:3]],  # shorter than the one before
        [],
    ]
    for prompt in prompts:
        # A counter of its own each time: no earlier list to start from.
        expected = ChatTokenCounter(counter.profile, counter.tokenizer).count_messages(prompt)
        assert counter.count_messages(prompt) == expected, prompt


def _recording_counter() -> tuple[ChatTokenCounter, list[str], Any]:
    """A counter of its own over gpt-4o's tokenizer that records every text it tokenizes, the
    list it records into, and the real tokenizer. Not counter_for's: that one is shared by the
    process (other tests use its tokenizer, and its cache may hold these texts already)."""
    shared = counter_for("gpt-4o")
    tokenized: list[str] = []
    real = shared.tokenizer

    class Counting:
        exact = real.exact

        def count(self, text: str) -> int:
            tokenized.append(text)
            return real.count(text)

    return ChatTokenCounter(shared.profile, Counting()), tokenized, real  # type: ignore[arg-type]


def test_a_short_text_counted_again_is_not_tokenized_again() -> None:
    """Memory packing counts the same memories on every turn: a look-up, not a tokenization,
    with the same counts as the tokenizer's, and long texts never kept."""
    counter, tokenized, real = _recording_counter()
    memory = "On 2026-11-30 the user said: my daughter is allergic to peanuts."
    long_output = "row " * 2000
    counts = [counter.count_text(memory) for _ in range(5)]
    assert counts == [real.count(memory)] * 5 and tokenized == [memory]
    assert counter.count_text(long_output) == counter.count_text(long_output)
    assert tokenized.count(long_output) == 2
    for number in range(10_000):  # bounded: the oldest texts make room
        counter.count_text(f"note {number}")
    assert len(counter._text_counts) <= 8192


def test_a_reply_counted_as_usage_is_not_tokenized_again_as_history() -> None:
    """A turn counts the model's reply (its usage), then the conversation counts its masked
    copy, another object with the same texts: its content, the tool's name and arguments are
    tokenized once, and the counts are the tokenizer's."""
    counter, tokenized, real = _recording_counter()
    fresh = ChatTokenCounter(counter.profile, real)
    call = ToolCall(id="c1", name="lookup", arguments='{"query": "item 7"}')
    reply = Message.assistant("Here is what I found about item 7.", tool_calls=[call])
    result = Message.tool("c1", "records for item 7: one entry", name="lookup")
    assert counter.count_message(reply) == fresh.count_message(reply)
    expected = fresh.count_message_content(reply.model_copy())
    assert counter.count_message_content(reply.model_copy()) == expected
    assert counter.count_message_content(result) == fresh.count_message_content(result)
    assert counter.count_message(result.model_copy()) == fresh.count_message(result)
    assert sorted(tokenized) == sorted([reply.content, "lookup", call.arguments, result.content]), (
        tokenized
    )


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4", "local:smollm2"])
def test_a_messages_content_tokens_are_its_count_less_its_framing(model: str) -> None:
    counter = counter_for(model)
    call = ToolCall(id="c1", name="lookup", arguments='{"query": "LHR"}')
    messages = [
        *(Message.user(text) for text in SAMPLES.values()),
        Message.assistant("", tool_calls=[call]),
        Message.assistant("Let me look.", tool_calls=[call]),
        Message.tool("c1", SAMPLES["json"], name="lookup"),
        Message.system(""),
    ]
    for message in messages:
        tokens = counter.count_message(message)
        framing = counter.count_message(message.model_copy(update={"content": ""}))
        expected = (tokens, max(0, tokens - framing))
        # Counted fresh (a copy), and after the message itself was counted.
        assert counter.count_message_content(message.model_copy()) == expected
        assert counter.count_message_content(message) == expected
