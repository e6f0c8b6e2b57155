"""The OpenAI facade as the official ``openai`` SDK uses it (sync, async, streamed), over real
HTTP: completions and their ids, failed and cut turns, generation parameters, the message
list, the model list."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.service._openai_service import CUT, OpenAIService, facade, users_words

__all__ = ["facade"]


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _turns_for(service: OpenAIService, words: str) -> int:
    """How many model calls answered ``words`` (one per turn that ran, for a normal answer)."""
    return sum(1 for call in service.model.calls if users_words(call) == words)


def test_streamed_and_whole_completions_share_one_id_and_report_usage(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    conversation = [_user("hello"), _assistant("Answer to hello"), _user("and now?")]
    with facade.sync(key) as client:
        whole = client.chat.completions.create(model="keel", messages=conversation)
        streamed = list(
            client.chat.completions.create(
                model="keel",
                messages=conversation,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert whole.choices[0].message.content == "Answer to and now?"
    assert whole.choices[0].finish_reason == "stop" and whole.id.startswith("chatcmpl-")
    # The same conversation sent again is the same turn: replayed, under the same id.
    assert {chunk.id for chunk in streamed} == {whole.id}
    assert _turns_for(facade, "and now?") == 1
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == "Answer to and now?"
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
    usage = streamed[-1].usage
    assert streamed[-1].choices == [] and usage is not None
    assert whole.usage is not None and usage.total_tokens == whole.usage.total_tokens > 0

    async def fresh_turn() -> tuple[str, list[str]]:
        async with facade.async_(key, session="s2") as client:
            answer = await client.chat.completions.create(model="keel", messages=[_user("hi")])
            stream = await client.chat.completions.create(
                model="keel", messages=[_user("hi again")], stream=True
            )
            ids = [chunk.id async for chunk in stream]
        return answer.id, ids

    answer_id, streamed_ids = asyncio.run(fresh_turn())
    assert answer_id.startswith("chatcmpl-") and len(set(streamed_ids)) == 1
    assert streamed_ids[0].startswith("chatcmpl-") and streamed_ids[0] != answer_id


def test_a_failed_turn_is_an_openai_error_with_its_status_never_the_apology(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        with pytest.raises(openai.APIStatusError) as whole:
            client.chat.completions.create(model="keel", messages=[_user("fail now")])
        # Failed before the first byte: the stream's request gets the same status.
        with pytest.raises(openai.APIStatusError) as streamed:
            list(
                client.chat.completions.create(
                    model="keel", messages=[_user("fail again")], stream=True
                )
            )
    for raised in (whole.value, streamed.value):
        assert raised.status_code == 502
        error = raised.response.json()["error"]
        assert error["code"] == "model_failed" and error["type"] == "server_error"
        assert "the provider is down" in error["message"] and "sorry" not in error["message"]
        assert set(error) == {"message", "type", "param", "code"}


def test_a_failure_after_the_first_chunk_is_an_error_event_the_sdk_raises(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    shown: list[str] = []

    async def stream() -> None:
        async with facade.async_(key) as client:
            chunks = await client.chat.completions.create(
                model="keel", messages=[_user("look it up")], stream=True
            )
            async for chunk in chunks:
                shown.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError, match="model_failed") as raised:
        asyncio.run(stream())
    assert not isinstance(raised.value, openai.APIStatusError)
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "model_failed"
    assert "".join(shown) == "Let me look." and "sorry" not in "".join(shown)


def test_a_reply_cut_at_the_token_limit_is_never_a_finished_answer(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        # The runtime continues a cut answer and reports one it could not finish.
        whole = client.chat.completions.create(model="keel", messages=[_user("cut it")])
        assert whole.choices[0].finish_reason == "length"
        assert (whole.choices[0].message.content or "").startswith(CUT)
        streamed = list(
            client.chat.completions.create(model="keel", messages=[_user("cut again")], stream=True)
        )
        reasons = [c.choices[0].finish_reason for c in streamed if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert reasons[-1] == "length" and text.startswith(CUT) and "sorry" not in text


def test_generation_parameters_are_this_turns_model_options(facade: OpenAIService) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        client.chat.completions.create(
            model="keel",
            messages=[_user("first")],
            max_tokens=7,
            temperature=0.3,
            stop=["END"],
            seed=42,
        )
        sent = facade.model.calls[-1].options
        assert (sent.max_tokens, sent.temperature, sent.stop, sent.seed) == (7, 0.3, ("END",), 42)
        client.chat.completions.create(
            model="keel", messages=[_user("second")], max_completion_tokens=9, stop="STOP"
        )
        sent = facade.model.calls[-1].options
        assert (sent.max_tokens, sent.stop, sent.temperature) == (9, ("STOP",), None)
        # OpenAI's defaults, as client libraries send them, change nothing: accepted.
        client.chat.completions.create(
            model="keel",
            messages=[_user("third")],
            n=1,
            top_p=1,
            presence_penalty=0,
            frequency_penalty=0,
        )
    assert _turns_for(facade, "third") == 1


@pytest.mark.parametrize(
    ("parameter", "value"),
    [
        ("n", 2),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("top_p", 0.5),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
        ("some_new_option", "x"),
    ],
)
def test_a_parameter_keel_cannot_honour_is_a_400_naming_it(
    facade: OpenAIService, parameter: str, value: object
) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client, pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="keel", messages=[_user("hi")], extra_body={parameter: value}
        )
    error = raised.value.response.json()["error"]
    assert error["param"] == parameter and error["type"] == "invalid_request_error"
    assert facade.model.calls == [], "a refused request ran a turn"


def test_a_parameter_out_of_its_range_is_a_422_naming_it(facade: OpenAIService) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client, pytest.raises(openai.UnprocessableEntityError) as raised:
        client.chat.completions.create(model="keel", messages=[_user("hi")], temperature=3)
    error = raised.value.response.json()["error"]
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    assert facade.model.calls == []


def test_a_list_that_ends_without_a_new_user_message_runs_no_turn(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        client.chat.completions.create(model="keel", messages=[_user("q")])
        answered = [_user("q"), _assistant("Answer to q")]
        tool_result = [*answered, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
        for messages in (answered, tool_result):
            with pytest.raises(openai.BadRequestError) as raised:
                client.chat.completions.create(model="keel", messages=messages)
            assert raised.value.response.json()["error"]["param"] == "messages"
    assert _turns_for(facade, "q") == 1


def test_a_resent_conversation_is_one_turn_and_the_same_words_again_are_two(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    conversation = [_user("book it"), _assistant("Answer to book it"), _user("yes")]
    with facade.sync(key) as client:
        first = client.chat.completions.create(model="keel", messages=conversation)
        again = client.chat.completions.create(model="keel", messages=conversation)
        assert again.id == first.id and again.model_extra is not None
        assert again.model_extra["keel"]["replayed"]
        assert _turns_for(facade, "yes") == 1
        # A client that sends only the newest message: the same words are a new turn...
        client.chat.completions.create(model="keel", messages=[_user("yes")])
        client.chat.completions.create(model="keel", messages=[_user("yes")])
        assert _turns_for(facade, "yes") == 3
        # ... and its retry names the turn with Idempotency-Key.
        for _ in range(2):
            client.chat.completions.create(
                model="keel",
                messages=[_user("yes")],
                extra_headers={"Idempotency-Key": "k1"},
            )
    assert _turns_for(facade, "yes") == 4


def test_the_model_list_answers_in_openais_shape(facade: OpenAIService) -> None:
    key = facade.keys.create("acme")
    with facade.http(key) as acme:
        listed = acme.get("/v1/models")
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    with facade.sync(key) as client:
        models = client.models.list()
        # The id the docs' clients send; the agent's name stays an alias.
        assert [model.id for model in models.data] == ["keel"]
        assert client.models.retrieve("keel").owned_by == "keel"
        assert client.models.retrieve("agent").id == "agent"
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve("gpt-5")
    assert raised.value.response.json()["error"]["code"] == "model_not_found"
    stranger = facade.sync("keel_0123456789ab_" + "x" * 43)
    with stranger, pytest.raises(openai.AuthenticationError) as refused:
        stranger.models.list()
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"


def test_an_error_before_the_first_chunk_is_the_streams_http_status(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    headers = {"Idempotency-Key": "order-1"}
    with facade.sync(key) as client:
        client.chat.completions.create(model="keel", messages=[_user("one")], extra_headers=headers)
        with pytest.raises(openai.APIError) as raised:
            list(
                client.chat.completions.create(
                    model="keel", messages=[_user("two")], stream=True, extra_headers=headers
                )
            )
    # Raised from the response's status, not from an event after a 200.
    assert isinstance(raised.value, openai.UnprocessableEntityError)
    assert "another message" in raised.value.response.json()["error"]["message"]


def test_a_parked_turn_is_answered_with_its_waiting_message_and_keels_status(
    facade: OpenAIService,
) -> None:
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        whole = client.chat.completions.create(model="keel", messages=[_user("pay the bill")])
        streamed = list(
            client.chat.completions.create(
                model="keel", messages=[_user("pay it again")], stream=True
            )
        )
    assert whole.choices[0].finish_reason == "stop" and whole.model_extra is not None
    assert whole.model_extra["keel"]["status"] == "tool_in_doubt"
    assert "A person will check it" in (whole.choices[0].message.content or "")
    last = streamed[-1].model_extra
    assert streamed[-1].choices[0].finish_reason == "stop" and last is not None
    assert last["keel"]["status"] == "tool_in_doubt"


def test_a_clients_max_tokens_caps_the_whole_answer(facade: OpenAIService) -> None:
    """OpenAI's max_tokens means "cut here": the cut answer comes back as it is, finish_reason
    length, after one model call, instead of being continued by the runtime."""
    key = facade.keys.create("acme")
    with facade.sync(key) as client:
        before = len(facade.model.calls)
        whole = client.chat.completions.create(
            model="keel", messages=[_user("cut short")], max_tokens=4
        )
        assert len(facade.model.calls) == before + 1
        assert whole.choices[0].finish_reason == "length"
        assert whole.choices[0].message.content == CUT
        streamed = list(
            client.chat.completions.create(
                model="keel", messages=[_user("cut short again")], max_tokens=4, stream=True
            )
        )
    reasons = [c.choices[0].finish_reason for c in streamed if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert (reasons[-1], text) == ("length", CUT)
