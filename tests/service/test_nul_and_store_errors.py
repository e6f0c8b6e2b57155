"""A NUL byte, on SQLite and on PostgreSQL alike, over real HTTP: refused with 422 before
anything is written (PostgreSQL text cannot hold one; a turn that answered 503 had already
committed), in every body, path and query parameter; and no error names the store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.errors import UsageError
from keel.service import build_service
from keel.testing import ScriptedModel
from tests.service.conftest import Service, _policy, _service, serving

_STORE_WORDS = ("postgres", "sqlite", "psycopg", "keel_test", "127.0.0.1", "database")


@pytest.fixture(params=["sqlite", "postgres"])
def backend_service(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Service]:
    """The service with memory on, on the embedded SQLite file or on PostgreSQL + Redis."""
    if request.param == "sqlite":
        yield from _service(tmp_path, memory=True)
        return
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    app, agents, keys = build_service(
        request.getfixturevalue("postgres_url"),
        model=ScriptedModel(_policy),
        redis_url=request.getfixturevalue("redis_url"),
        memory=True,
    )
    with serving(app) as running:
        yield Service(running.url, keys, tmp_path, [], agents)


def _no_store_named(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    message = json.dumps(response.json()).lower()
    assert not any(word in message for word in _STORE_WORDS), message


def test_a_nul_in_a_message_is_422_and_nothing_is_written(backend_service: Service) -> None:
    service = backend_service
    with service.client(service.keys.create("acme")) as acme:
        for _ in range(2):  # a client's retry changes nothing either
            answer = acme.post("/v1/sessions/s1/turns", json={"message": "he\x00llo", "user": "u1"})
            assert answer.status_code == 422, answer.text
            _no_store_named(answer)
        chat = {"model": "keel", "messages": [{"role": "user", "content": "Book\x00 Oslo"}]}
        headers = {"X-Keel-Session": "s1", "X-Keel-User": "u1"}
        assert acme.post("/v1/chat/completions", json=chat, headers=headers).status_code == 422
        note = acme.post("/v1/memory", json={"user": "u1", "text": "dog\x00Rex"})
        assert note.status_code == 422, note.text
        assert acme.get("/v1/sessions/s1").status_code == 404
        assert acme.get("/v1/runs").json() == []
        assert acme.get("/v1/memory/search", params={"user": "u1", "q": "dog"}).json() == []
        # The same session then takes a clean message as its first turn.
        clean = acme.post("/v1/sessions/s1/turns", json={"message": "Book Oslo", "user": "u1"})
        assert clean.status_code == 200 and clean.json()["status"] == "completed"
        runs = acme.get("/v1/runs").json()
        assert [run["input"] for run in runs] == ["Book Oslo"]


def test_agent_run_refuses_a_nul_on_both_backends(backend_service: Service) -> None:
    agent = backend_service.agents("acme")
    with pytest.raises(UsageError, match="NUL"):
        agent.run_sync("he\x00llo", session="s1", user="u1")
    assert agent.session_state("s1") is None


_NUL_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "/v1/runs/%00", {}),
    ("GET", "/v1/runs", {"params": {"session": "\x00"}}),
    ("GET", "/v1/sessions/%00", {}),
    ("GET", "/v1/sessions/s%00/checkpoints", {}),
    ("GET", "/v1/sessions/s%00/in-doubt", {}),
    ("POST", "/v1/sessions/s%00/revert", {"json": {"version": 1, "expected_version": 1}}),
    ("POST", "/v1/sessions/s%00/turns", {"json": {"message": "hi", "user": "u1"}}),
    ("POST", "/v1/sessions/s1/turns", {"json": {"message": "hi", "user": "u\x00"}}),
    ("GET", "/v1/memory/search", {"params": {"user": "\x00", "q": "dog"}}),
    ("GET", "/v1/memory/search", {"params": {"user": "u1", "q": "\x00"}}),
    ("POST", "/v1/memory", {"json": {"user": "u\x00", "text": "dog"}}),
    ("DELETE", "/v1/memory/%00", {"params": {"user": "u1"}}),
    ("DELETE", "/v1/memory/r1", {"params": {"user": "\x00"}}),
    ("POST", "/v1/tools/in-doubt/%00/resolve", {"json": {"ok": True, "content": "done"}}),
    ("POST", "/v1/tools/in-doubt/k1/resolve", {"json": {"ok": True, "content": "x\x00"}}),
]


def test_a_nul_in_any_parameter_is_422_or_404_and_names_no_store(
    backend_service: Service,
) -> None:
    service = backend_service
    with service.client(service.keys.create("acme")) as acme:
        for method, path, options in _NUL_REQUESTS:
            answer = acme.request(method, path, **options)
            assert answer.status_code in (404, 422), (method, path, options, answer.text)
            _no_store_named(answer)
        assert acme.get("/v1/runs").json() == []


def test_a_blank_or_nul_user_is_refused_by_memory_as_by_turns(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        for user in ("", " ", "\t", "u\x00", "\x00", "u\n1"):
            turn = acme.post("/v1/sessions/s1/turns", json={"message": "hi", "user": user})
            note = acme.post("/v1/memory", json={"user": user, "text": "dog"})
            assert (turn.status_code, note.status_code) == (422, 422), (user, note.text)
            assert note.json()["error"]["type"] == "ValidationError"


def test_a_store_that_is_down_is_503_without_its_name_host_or_driver(postgres_url: str) -> None:
    from keel.testing.servers import redis_server
    from tests.service.test_postgres_service import _shut_down

    with redis_server() as own_redis:
        app, _, keys = build_service(
            postgres_url, model=ScriptedModel(lambda call: "ok"), redis_url=own_redis, memory=False
        )
        port = own_redis.rsplit(":", 1)[-1].split("/")[0]
        with serving(app) as running:
            headers = {"Authorization": f"Bearer {keys.create('acme')}"}
            with httpx.Client(base_url=running.url, headers=headers, timeout=60) as acme:
                assert acme.get("/v1/sessions/s1").status_code == 404
                _shut_down(own_redis)  # the state store goes away under the running server
                down = acme.get("/v1/sessions/s1")
                assert down.status_code == 503, down.text
                message = down.json()["error"]["message"].lower()
                assert not any(word in message for word in (*_STORE_WORDS, "redis", port))
