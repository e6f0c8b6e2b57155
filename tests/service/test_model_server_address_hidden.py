"""A turn that failed because the model server could not be reached answered the client with
the server's address (``cannot reach http://10.0.0.5:8000/v1: ...``): an internal URL, in
``reply.error`` and in the chat completion's error. The client is told what failed ("cannot
reach the model server"); the operator's log line and the run's trace keep the address."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.models import OpenAICompatibleModel, RetryPolicy
from tests.service.conftest import Service, _service


@pytest.fixture
def address() -> str:
    with socket.socket() as probe:  # a port nothing listens on (bound, then released)
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def unreachable(tmp_path: Path, address: str) -> Iterator[Service]:
    once = RetryPolicy(max_attempts=1)  # one refused connection says it all
    model = OpenAICompatibleModel("m", base_url=f"http://{address}/v1", api_key="k", retry=once)
    yield from _service(tmp_path, memory=False, model=model)  # type: ignore[arg-type]


def test_a_client_is_told_the_model_server_failed_not_where_it_is(
    unreachable: Service, address: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = unreachable.keys.create("acme", user_id="u1")
    with caplog.at_level(logging.WARNING, logger="keel.service"), unreachable.client(key) as api:
        turn = api.post("/v1/sessions/s1/turns", json={"message": "hi"}).json()
        streamed = api.post(
            "/v1/sessions/s2/turns", json={"message": "hi"}, headers={"Accept": "text/event-stream"}
        ).text
        chat = {"model": "keel", "messages": [{"role": "user", "content": "hi"}]}
        completion = api.post("/v1/chat/completions", json=chat, headers={"X-Keel-Session": "s3"})
    assert turn["status"] == "model_failed"
    assert turn["error"] == "cannot reach the model server: Connection error.", turn
    finished = [
        line for line in streamed.splitlines() if line.startswith("data:") and '"final"' in line
    ]
    assert finished and "cannot reach the model server" in finished[-1], streamed
    assert completion.status_code == 502
    assert "cannot reach the model server" in completion.json()["error"]["message"]
    for told in (json.dumps(turn), streamed, completion.text):
        assert address not in told, told
    # The operator's log names the server, once per failed turn.
    logged = [r.getMessage() for r in caplog.records if address in r.getMessage()]
    assert len(logged) == 3 and all("cannot reach http://" in line for line in logged), logged


def test_a_failed_runs_trace_read_over_http_does_not_say_where_the_model_server_is(
    unreachable: Service, address: str
) -> None:
    key = unreachable.keys.create("acme", user_id="u1")
    with unreachable.client(key) as api:
        turn = api.post("/v1/sessions/s1/turns", json={"message": "hi"}).json()
        listed = api.get("/v1/runs").text
        detail = api.get(f"/v1/runs/{turn['run_id']}")
    assert detail.status_code == 200
    # The trace stores the address's host masked (an IP address), its port and path as written.
    port = address.rsplit(":", 1)[1]
    told_error = detail.json()["run"]["error_message"]
    assert told_error == "cannot reach the model server: Connection error.", told_error
    for told in (listed, detail.text):
        assert address not in told and f":{port}/v1" not in told, told[:400]
    # The trace itself keeps it, for the operator reading the store.
    with sqlite3.connect(unreachable.database) as db:
        [(stored,)] = db.execute(
            "SELECT error_message FROM trace_runs WHERE run_id = ?", (turn["run_id"],)
        ).fetchall()
    assert stored.startswith("cannot reach http://") and f":{port}/v1" in stored, stored
