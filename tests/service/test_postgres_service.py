"""The service on PostgreSQL + Redis (real servers started by the tests): keys, tenancy and an
idempotent turn, over real HTTP, exactly as on SQLite."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from keel.service import APIKeys, build_service
from keel.testing import ScriptedModel
from tests.service.conftest import serving


@pytest.fixture
def pg_service(postgres_url: str, redis_url: str) -> Iterator[tuple[str, APIKeys]]:
    app, _, keys = build_service(
        postgres_url,
        model=ScriptedModel(lambda call: f"echo: {call.last_user_text}"),
        redis_url=redis_url,
        memory=False,
    )
    # On exit the server's lifespan closes the agents' stores.
    with serving(app) as running:
        yield running.url, keys


def test_the_service_on_postgres_and_redis(pg_service: tuple[str, APIKeys]) -> None:
    url, keys = pg_service
    acme_key, globex_key = keys.create("acme"), keys.create("globex")
    assert keys.tenant_of(acme_key) == "acme"
    acme = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {acme_key}"}, timeout=30)
    globex = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {globex_key}"}, timeout=30
    )
    with acme, globex:
        body = {"message": "hello", "user": "u1"}
        headers = {"Idempotency-Key": "k1"}
        first = acme.post("/v1/sessions/s1/turns", json=body, headers=headers).json()
        again = acme.post("/v1/sessions/s1/turns", json=body, headers=headers).json()
        assert first["text"] == "echo: hello" and again["replayed"]
        state = acme.get("/v1/sessions/s1").json()
        assert [m["content"] for m in state["state"]["messages"]] == ["hello", "echo: hello"]
        assert globex.get("/v1/sessions/s1").status_code == 404
        assert globex.get(f"/v1/runs/{first['run_id']}").status_code == 404
        assert [run["run_id"] for run in acme.get("/v1/runs").json()] == [first["run_id"]]
