"""``keel serve``'s HTTP API over real HTTP (uvicorn on a loopback port, httpx), on SQLite:
keys and tenants, turns as JSON and as server-sent events, sessions, runs, typed errors."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import httpx
import pytest

from tests.service.conftest import EMAIL, Service


def _turn(client: httpx.Client, session: str, text: str, user: str = "u1") -> httpx.Response:
    return client.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": user})


def test_every_route_but_health_and_ready_needs_a_valid_key(service: Service) -> None:
    with service.client(None) as anonymous:
        assert anonymous.get("/health").json() == {"status": "ok"}
        assert anonymous.get("/ready").json() == {"status": "ready"}
        for method, path in (("GET", "/v1/sessions/s1"), ("GET", "/v1/runs")):
            response = anonymous.request(method, path)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "Unauthorized"
        assert _turn(anonymous, "s1", "Book Oslo").status_code == 401
    forged = "keel_0123456789ab_" + "x" * 43
    with service.client(forged) as bad:
        assert bad.get("/v1/runs").status_code == 401


def test_only_a_hash_of_each_key_is_stored(service: Service) -> None:
    key = service.keys.create("acme")
    secret = key.split("_", 2)[2]
    with sqlite3.connect(service.database) as conn:
        stored = conn.execute("SELECT * FROM keel_api_keys").fetchall()
    assert stored and secret not in json.dumps(stored)
    assert service.keys.tenant_of(key) == "acme"
    assert service.keys.tenant_of(key[:-1] + ("A" if key[-1] != "A" else "B")) is None


def test_a_turn_as_json_then_the_session_and_its_runs(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        response = _turn(acme, "s1", f"Mail me at {EMAIL}, book Oslo")
        assert response.status_code == 200, response.text
        reply = response.json()
        # The embedded default keeps a vault: the user reads their own address back, while
        # what is stored holds its placeholder.
        assert reply["status"] == "completed" and EMAIL in reply["text"]
        assert service.booked == ["Oslo"]
        session = acme.get("/v1/sessions/s1").json()
        assert session["version"] == reply["state_version"]
        assert EMAIL not in json.dumps(session), "PII reached the stored state"
        history = acme.get("/v1/sessions/s1/checkpoints").json()
        assert history[0]["version"] == reply["state_version"]
        runs = acme.get("/v1/runs", params={"session": "s1"}).json()
        assert [run["run_id"] for run in runs] == [reply["run_id"]]
        detail = acme.get(f"/v1/runs/{reply['run_id']}").json()
        assert [step["kind"] for step in detail["steps"]].count("model") == 2


def test_a_tenant_never_sees_another_tenants_sessions_or_runs(service: Service) -> None:
    with (
        service.client(service.keys.create("acme")) as acme,
        service.client(service.keys.create("globex")) as globex,
    ):
        reply = _turn(acme, "s1", "Book Oslo").json()
        assert globex.get("/v1/sessions/s1").status_code == 404
        assert globex.get("/v1/sessions/s1/checkpoints").status_code == 404
        assert globex.get(f"/v1/runs/{reply['run_id']}").status_code == 404
        assert globex.get("/v1/runs").json() == []
        # The same session id in another tenant is another session.
        assert _turn(globex, "s1", "Book Lima").json()["status"] == "completed"
        acme_state = acme.get("/v1/sessions/s1").json()["state"]
        assert [m["content"] for m in acme_state["messages"] if m["role"] == "user"] == [
            "Book Oslo"
        ]
        # Another user of the same tenant does not get the session either.
        other = _turn(acme, "s1", "Book Pune", user="u2")
        assert other.status_code == 404 and other.json()["error"]["type"] == "NotFound"
    assert service.booked == ["Oslo", "Lima"]


def test_a_turn_streams_as_server_sent_events(service: Service) -> None:
    with (
        service.client(service.keys.create("acme")) as acme,
        acme.stream(
            "POST",
            "/v1/sessions/s1/turns",
            json={"message": f"For {EMAIL}, book Oslo", "user": "u1"},
            headers={"Accept": "text/event-stream"},
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "final" and "tool_call_started" in kinds and "checkpoint" in kinds
    text = "".join(event["text"] for event in events if event["type"] == "text")
    # The user's own address, revealed to them by the embedded default's vault.
    assert text == events[-1]["reply"]["text"] and EMAIL in text


def test_bad_input_gets_a_typed_error_and_changes_nothing(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        malformed = acme.post(
            "/v1/sessions/s1/turns",
            content=b'{"message": "hi", ',
            headers={"Content-Type": "application/json"},
        )
        assert malformed.status_code == 400
        assert malformed.json()["error"]["type"] == "MalformedJSON"
        missing = acme.post("/v1/sessions/s1/turns", json={"message": "hi"})
        assert missing.status_code == 422 and "user" in missing.json()["error"]["message"]
        extra = acme.post("/v1/sessions/s1/turns", json={"message": "hi", "user": "u", "x": 1})
        assert extra.status_code == 422
        huge = _turn(acme, "s1", "x" * 20_000)
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "BodyTooLarge"
        assert acme.get("/v1/runs/nope").status_code == 404
        assert acme.get("/v1/runs", params={"status": "bogus"}).status_code == 422
        assert acme.get("/v1/sessions/s1").status_code == 404, "a refused request wrote state"
    assert service.booked == []


def test_a_turn_sent_again_with_its_idempotency_key_runs_once(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        headers = {"Idempotency-Key": "order-7f3a"}
        body = {"message": "Book Oslo", "user": "u1"}
        first = acme.post("/v1/sessions/s1/turns", json=body, headers=headers).json()
        second = acme.post("/v1/sessions/s1/turns", json=body, headers=headers).json()
        assert service.booked == ["Oslo"]
        assert second["replayed"] and second["text"] == first["text"]
        assert second["run_id"] == first["run_id"]
        reused = acme.post(
            "/v1/sessions/s1/turns", json={"message": "Book Lima", "user": "u1"}, headers=headers
        )
        assert reused.status_code == 422 and "another message" in reused.json()["error"]["message"]
        # Keys are the tenant's own: the same key in another tenant is another request.
    with service.client(service.keys.create("globex")) as globex:
        other = globex.post("/v1/sessions/s1/turns", json=body, headers=headers).json()
        assert not other["replayed"]
    assert service.booked == ["Oslo", "Oslo"]


def test_the_openai_sdk_talks_to_the_agent_through_the_facade(service: Service) -> None:
    from openai import OpenAI

    key = service.keys.create("acme")
    client = OpenAI(
        base_url=f"{service.url}/v1",
        api_key=key,
        default_headers={"X-Keel-Session": "s1", "X-Keel-User": "u1"},
    )
    # Each client is closed: an unclosed one leaks its socket into a later test's warnings.
    closing = contextlib.ExitStack()
    closing.enter_context(client)
    completion = client.chat.completions.create(
        model="keel", messages=[{"role": "user", "content": f"For {EMAIL} book Oslo"}]
    )
    text = completion.choices[0].message.content
    # The user's own address, revealed to them; the session stores its placeholder.
    assert text is not None and text.startswith("Booked: trip to Oslo") and EMAIL in text
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    # The client sends only the newest message: keel keeps the session.
    stream = client.chat.completions.create(
        model="keel", messages=[{"role": "user", "content": "now book Lima"}], stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed.startswith("Booked: trip to Lima")
    assert service.booked == ["Oslo", "Lima"]
    with service.client(key) as acme:
        state = acme.get("/v1/sessions/s1").json()["state"]
    users = [m["content"] for m in state["messages"] if m["role"] == "user"]
    assert users == ["For <EMAIL_1> book Oslo", "now book Lima"]
    # An operator key that names no user: the facade says how to name one.
    bare = closing.enter_context(OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0))
    with closing, pytest.raises(Exception, match="OpenAI's user field"):
        bare.chat.completions.create(model="keel", messages=[{"role": "user", "content": "hi"}])


def test_revert_is_compare_and_set_and_scoped_to_the_tenant(service: Service) -> None:
    with (
        service.client(service.keys.create("acme")) as acme,
        service.client(service.keys.create("globex")) as globex,
    ):
        first = _turn(acme, "s1", "Book Oslo").json()
        second = _turn(acme, "s1", "Book Lima").json()
        body = {"version": first["state_version"], "expected_version": second["state_version"]}
        assert globex.post("/v1/sessions/s1/revert", json=body).status_code == 404
        reverted = acme.post("/v1/sessions/s1/revert", json=body)
        assert reverted.status_code == 200, reverted.text
        state = acme.get("/v1/sessions/s1").json()
        assert state["version"] == reverted.json()["version"] > second["state_version"]
        users = [m["content"] for m in state["state"]["messages"] if m["role"] == "user"]
        assert users == ["Book Oslo"]
        stale = acme.post("/v1/sessions/s1/revert", json=body)  # read before the revert
        assert stale.status_code == 409 and stale.json()["error"]["type"] == "ConflictError"


def test_a_revert_to_a_version_no_store_can_hold_is_404(service: Service) -> None:
    # SQLite raised OverflowError past 2**63 (a 500), PostgreSQL "integer out of range" past
    # 2**31 (a StoreError: 503 with Retry-After, as if the database were down).
    with service.client(service.keys.create("acme")) as acme:
        head = _turn(acme, "s1", "Book Oslo").json()["state_version"]
        for version in (2**31, 10**20):
            body = {"version": version, "expected_version": head}
            answer = acme.post("/v1/sessions/s1/revert", json=body)
            assert answer.status_code == 404, answer.text
            assert f"no stored version {version}" in answer.json()["error"]["message"]
        assert acme.get("/v1/sessions/s1").json()["version"] == head


def test_in_doubt_calls_are_listed_and_resolved_within_the_tenant(service: Service) -> None:
    from keel.runtime import session_key
    from keel.stores import SQLiteDatabase, SQLToolJournal

    database = SQLiteDatabase(service.database)
    journal = SQLToolJournal(database)
    claim = journal.claim(
        key="k-1", session_id=session_key("acme", "s1"), step=3, call_index=0,
        tool="book", arguments='{"city": "Oslo"}',
    )  # fmt: skip
    assert claim.entry.in_doubt
    with (
        service.client(service.keys.create("acme")) as acme,
        service.client(service.keys.create("globex")) as globex,
    ):
        listed = acme.get("/v1/sessions/s1/in-doubt").json()
        assert [entry["key"] for entry in listed] == ["k-1"]
        assert globex.get("/v1/sessions/s1/in-doubt").json() == []
        verdict = {"ok": True, "content": "booked, reference R1 (checked with the airline)"}
        assert globex.post("/v1/tools/in-doubt/k-1/resolve", json=verdict).status_code == 404
        resolved = acme.post("/v1/tools/in-doubt/k-1/resolve", json=verdict)
        assert resolved.status_code == 200 and resolved.json()["ok"] is True
        assert acme.get("/v1/sessions/s1/in-doubt").json() == []
        assert acme.post("/v1/tools/in-doubt/k-1/resolve", json=verdict).status_code == 404
    database.close()


def test_memory_is_searched_added_and_forgotten_within_the_users_scope(
    memory_service: Service,
) -> None:
    service = memory_service
    with (
        service.client(service.keys.create("acme")) as acme,
        service.client(service.keys.create("globex")) as globex,
    ):
        added = acme.post("/v1/memory", json={"user": "u1", "text": f"My dog Rex; mail {EMAIL}"})
        assert added.status_code == 201, added.text
        record = added.json()
        assert EMAIL not in json.dumps(record), "PII reached memory unmasked"
        hits = acme.get("/v1/memory/search", params={"user": "u1", "q": "dog Rex"}).json()
        assert [hit["record"]["id"] for hit in hits][:1] == [record["id"]]
        assert "keyword_rank" in hits[0]
        # Another user, and another tenant, find nothing and cannot forget it.
        assert acme.get("/v1/memory/search", params={"user": "u2", "q": "dog Rex"}).json() == []
        assert globex.get("/v1/memory/search", params={"user": "u1", "q": "dog Rex"}).json() == []
        path = f"/v1/memory/{record['id']}"
        assert globex.delete(path, params={"user": "u1"}).status_code == 404
        assert acme.delete(path, params={"user": "u2"}).status_code == 404
        assert acme.delete(path, params={"user": "u1"}).status_code == 200
        assert acme.get("/v1/memory/search", params={"user": "u1", "q": "dog Rex"}).json() == []


def test_metrics_need_the_operators_token_and_count_turns_and_indicators(
    service: Service,
) -> None:
    from tests.service.conftest import METRICS_TOKEN

    key = service.keys.create("acme")
    with service.client(key) as acme:
        _turn(acme, "s1", "Book Oslo")
        assert acme.get("/metrics").status_code == 401, "a tenant key read the metrics"
    with service.client(METRICS_TOKEN) as operator:
        text = operator.get("/metrics").text
    assert 'keel_turns_total{tenant="acme",status="completed"} 1' in text
    assert 'keel_model_calls_window{tenant="acme"} 2' in text
    assert 'keel_retry_rate{tenant="acme"} 0' in text
    assert 'route="/v1/sessions/{session_id}/turns",status="200"} 1' in text


def test_a_key_over_its_rate_gets_429_with_retry_after(limited_service: Service) -> None:
    service = limited_service
    with (
        service.client(service.keys.create("acme")) as first,
        service.client(service.keys.create("acme")) as second,
    ):
        assert [first.get("/v1/runs").status_code for _ in range(3)] == [200, 200, 200]
        limited = first.get("/v1/runs")
        assert limited.status_code == 429 and limited.json()["error"]["type"] == "RateLimited"
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
        assert second.get("/v1/runs").status_code == 200, "the limit is per key"
