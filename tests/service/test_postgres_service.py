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


def test_ready_once_the_pool_is_warm_and_503_while_a_store_is_down(postgres_url: str) -> None:
    import psycopg

    from keel.service import WARM_CONNECTIONS
    from keel.testing.servers import redis_server

    def connections() -> int:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert row is not None
        return int(row[0])

    with redis_server() as own_redis:
        app, _, _ = build_service(
            postgres_url,
            model=ScriptedModel(lambda call: "ok"),
            redis_url=own_redis,
            memory=False,
        )
        with serving(app) as running:
            # Start-up opened the connections the first turns overlap on, before any request.
            assert connections() >= WARM_CONNECTIONS
            ready = httpx.get(f"{running.url}/ready", timeout=30)
            assert ready.status_code == 200 and ready.json() == {"status": "ready"}
            _shut_down(own_redis)  # the state store goes away under the running server
            down = httpx.get(f"{running.url}/ready", timeout=30)
            assert down.status_code == 503, down.text
            assert down.json()["error"]["type"] == "BackendUnavailableError"
            assert httpx.get(f"{running.url}/health", timeout=5).status_code == 200


def _shut_down(redis_url: str) -> None:
    import contextlib

    import redis

    client = redis.Redis.from_url(redis_url)
    with contextlib.suppress(redis.ConnectionError):  # it hangs up as it goes
        client.shutdown(nosave=True)
    client.close()
