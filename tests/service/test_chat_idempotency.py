"""``Idempotency-Key`` on ``/v1/chat/completions``, over real HTTP: a resent request, streamed
or not, books once; the second reply is the first one, replayed."""

from __future__ import annotations

import json

import httpx

from tests.service.conftest import Service


def _streamed_text(client: httpx.Client, body: dict[str, object], headers: dict[str, str]) -> str:
    text = ""
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                    text += choice["delta"].get("content") or ""
    return text


def test_a_chat_completion_resent_with_its_idempotency_key_books_once(service: Service) -> None:
    body = {"model": "keel", "messages": [{"role": "user", "content": "Book Oslo"}]}
    with service.client(service.keys.create("acme")) as acme:
        headers = {"X-Keel-Session": "c1", "X-Keel-User": "u1", "Idempotency-Key": "order-1"}
        first = acme.post("/v1/chat/completions", json=body, headers=headers).json()
        second = acme.post("/v1/chat/completions", json=body, headers=headers).json()
        assert service.booked == ["Oslo"]
        assert not first["keel"]["replayed"] and second["keel"]["replayed"]
        assert second["keel"]["run_id"] == first["keel"]["run_id"]
        assert second["choices"][0]["message"] == first["choices"][0]["message"]

        streamed = {**body, "stream": True, "messages": [{"role": "user", "content": "Book Lima"}]}
        headers = {"X-Keel-Session": "c2", "X-Keel-User": "u1", "Idempotency-Key": "order-2"}
        texts = [_streamed_text(acme, streamed, headers) for _ in range(2)]
        assert service.booked == ["Oslo", "Lima"]
        assert texts[0] == texts[1] and "Lima" in texts[0]
        assert len(acme.get("/v1/runs", params={"session": "c2"}).json()) == 1
        # Sent again without a key, the same words are a new turn.
        headers.pop("Idempotency-Key")
        _streamed_text(acme, streamed, headers)
    assert service.booked == ["Oslo", "Lima", "Lima"]
