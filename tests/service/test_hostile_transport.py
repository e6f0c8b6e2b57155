"""The service against hostile and sloppy clients, at the transport: bodies sent chunked past
the limit, bodies and headers that never finish, the same key spelled many ways; and what the
service logs of each request. Raw sockets where an HTTP client would tidy the request up."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from keel.service import APIKeys, Drain, DrainingServer, ServiceAgents, create_app
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from tests.service.conftest import Service, _service, serving

LIMIT = 10_000
"""The body limit of the ``service`` fixture."""


@pytest.fixture
def impatient_service(tmp_path: Path) -> Iterator[Service]:
    """The service giving a body 1 s to arrive."""
    yield from _service(tmp_path, memory=False, body_timeout_s=1.0)


@pytest.fixture
def roomy_service(tmp_path: Path) -> Iterator[Service]:
    """The service with the default body limit (1 MB)."""
    yield from _service(tmp_path, memory=False, max_body_bytes=1_000_000)


def _chunked(parts: Iterable[bytes]) -> Iterator[bytes]:
    for part in parts:
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"
    yield b"0\r\n\r\n"


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Raw:
    """One raw connection to the service."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        address = urlsplit(url)
        self.sock = socket.create_connection((address.hostname, address.port), timeout=timeout_s)

    def send(self, *data: bytes) -> Raw:
        for part in data:
            self.sock.sendall(part)
        return self

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and whatever of the body came with them."""
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pytest.fail(f"no response from the server (got {data[:200]!r})")
        assert b"\r\n\r\n" in data, f"the server closed without a response: {data[:200]!r}"
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        while len(body) < int(headers.get("content-length", 0)):
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        """Whether the server closes the connection (it reads to the end)."""
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return True

    def close(self) -> None:
        self.sock.close()


def _logged(caplog: pytest.LogCaptureFixture, logger: str, count: int) -> list[logging.LogRecord]:
    """The records of ``logger``, once there are ``count`` (the gate logs a request after its
    response is out: the client may have it first)."""
    deadline = time.monotonic() + 10
    while True:
        records = [r for r in caplog.records if r.name == logger]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.01)


def _key(service: Service) -> str:
    return service.keys.create("acme")


# A body of each POST route, padded past the limit (valid JSON, so only its size is wrong).
_PADDING = "x" * (2 * LIMIT)
_OVERSIZED = {
    "/v1/sessions/s1/turns": f'{{"message": "{_PADDING}", "user": "u1"}}',
    "/v1/chat/completions": (
        '{"model": "m", "messages": [{"role": "user", "content": "'
        + _PADDING
        + '"}], "metadata": {"session_id": "s1", "user_id": "u1"}}'
    ),
    "/v1/memory": f'{{"user": "u1", "text": "{_PADDING[:9000]}", "kind": "semantic"}}'
    + " " * LIMIT,
    "/v1/sessions/s1/revert": '{"version": 1, "expected_version": 1}' + " " * (2 * LIMIT),
    "/v1/tools/in-doubt/k1/resolve": f'{{"ok": true, "content": "{_PADDING[:9000]}"}}'
    + " " * LIMIT,
}


@pytest.mark.parametrize("path", sorted(_OVERSIZED))
def test_a_chunked_body_past_the_limit_gets_413_on_every_route(service: Service, path: str) -> None:
    """Sent chunked, a body has no Content-Length to refuse it by: its bytes are counted as
    they come, and at the limit the request is refused and the connection closed."""
    # Just past the limit, and no more: a client still sending when the server closes would
    # have its connection reset, and might never read the answer.
    body = _OVERSIZED[path].encode()[: LIMIT + 2000]
    parts = [body[i : i + 1000] for i in range(0, len(body), 1000)]
    headers = {
        "Authorization": f"Bearer {_key(service)}",
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
    }
    chunks = list(_chunked(parts))[:-1]  # the body never ends
    raw = Raw(service.url, timeout_s=10).send(_head("POST", path, headers), *chunks)
    try:
        status, response_headers, _ = raw.response()
        assert status == 413, (path, status)
        assert response_headers.get("connection") == "close"
        assert raw.closed_by_server(), "the rest of an oversized body would be read"
    finally:
        raw.close()
    assert service.booked == []


def test_a_chunked_body_under_the_limit_is_served(service: Service) -> None:
    body = b'{"message": "book Paris", "user": "u1"}'
    headers = {
        "Authorization": f"Bearer {_key(service)}",
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
    }
    raw = Raw(service.url).send(
        _head("POST", "/v1/sessions/s1/turns", headers), *_chunked([body[:10], body[10:]])
    )
    try:
        status, _, _ = raw.response()
    finally:
        raw.close()
    assert status == 200
    assert service.booked == ["Paris"]


@pytest.mark.parametrize("path", ["/v1/sessions/s1/turns", "/v1/memory"])
def test_a_body_that_never_arrives_whole_gets_408_and_the_connection_closes(
    impatient_service: Service, path: str
) -> None:
    headers = {
        "Authorization": f"Bearer {_key(impatient_service)}",
        "Content-Type": "application/json",
        "Content-Length": "100",
    }
    raw = Raw(impatient_service.url).send(_head("POST", path, headers), b'{"message":')
    try:
        status, response_headers, body = raw.response()
        assert status == 408 and b"RequestTimeout" in body
        assert response_headers.get("connection") == "close"
        assert raw.closed_by_server()
    finally:
        raw.close()


def test_a_turn_without_a_key_is_refused_before_its_body_and_never_counts_in_flight(
    tmp_path: Path,
) -> None:
    """The issue's client: a turn POST declaring 100 bytes, sending 10, with no key. It is
    answered 401 at once; a drain never waits on it."""
    drain = Drain()
    for service in _service(tmp_path, memory=False, drain=drain):
        headers = {"Content-Type": "application/json", "Content-Length": "100"}
        raw = Raw(service.url).send(_head("POST", "/v1/sessions/s1/turns", headers), b"0123456789")
        try:
            status, _, body = raw.response()
            assert status == 401 and b"Unauthorized" in body
            assert drain.in_flight == 0
        finally:
            raw.close()


_SPELLINGS = (
    "Bearer {key}",
    "bearer {key}",
    "BEARER {key}",
    "bEaReR {key}",
    "Bearer  {key}",
    "Bearer\t{key}",
    "Bearer \t {key}",
    "Bearer {key}   ",
)


def _get_runs(url: str, authorization: str) -> tuple[int, dict[str, str]]:
    """``GET /v1/runs`` with the ``Authorization`` header's bytes as given (an HTTP client
    would tidy them)."""
    headers = {"Authorization": authorization, "Connection": "close"}
    raw = Raw(url).send(_head("GET", "/v1/runs", headers))
    try:
        status, response_headers, _ = raw.response()
    finally:
        raw.close()
    return status, response_headers


def test_every_spelling_of_a_bearer_key_is_the_same_key(service: Service) -> None:
    key = _key(service)
    for spelling in _SPELLINGS:
        assert _get_runs(service.url, spelling.format(key=key))[0] == 200, repr(spelling)
    for wrong in ("Bearer", f"Basic {key}", f"Bearer {key} more", key, f"Bearer{key}"):
        assert _get_runs(service.url, wrong)[0] == 401, repr(wrong)


def test_a_limited_key_stays_limited_however_its_header_is_spelled(
    limited_service: Service,
) -> None:
    """3 requests a minute: once the key is over, no spelling of it gets through."""
    key = _key(limited_service)
    for _ in range(3):
        response = httpx.get(
            f"{limited_service.url}/v1/runs", headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200
    for spelling in _SPELLINGS:
        status, headers = _get_runs(limited_service.url, spelling.format(key=key))
        assert status == 429, repr(spelling)
        assert int(headers["retry-after"]) >= 1


def test_the_chat_route_caps_each_message_and_the_whole_list(roomy_service: Service) -> None:
    """As a turn's message is capped at 100k characters, so is a chat completion's."""
    key = _key(roomy_service)
    headers = {"Authorization": f"Bearer {key}", "X-Keel-Session": "s1", "X-Keel-User": "u1"}

    def chat(messages: list[dict[str, object]]) -> httpx.Response:
        body = {"model": "keel", "messages": messages}
        return httpx.post(
            f"{roomy_service.url}/v1/chat/completions", json=body, headers=headers, timeout=30
        )

    one_long = chat([{"role": "user", "content": "y" * 100_001}])
    assert one_long.status_code == 422, one_long.text
    parts = chat([{"role": "user", "content": [{"type": "text", "text": "y" * 100_001}]}])
    assert parts.status_code == 422, parts.text
    many = [{"role": "user", "content": "z" * 40_000} for _ in range(3)]
    assert chat(many).status_code == 422
    assert roomy_service.booked == []
    fine = chat([{"role": "user", "content": "book Rome"}])
    assert fine.status_code == 200, fine.text
    assert roomy_service.booked == ["Rome"]


def test_one_access_line_per_request_with_no_key_and_no_body(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    key = _key(service)
    caplog.set_level(logging.INFO, logger="keel.access")
    with service.client(key) as client:
        reply = client.post("/v1/sessions/s1/turns", json={"message": "book Oslo", "user": "u1"})
        assert reply.status_code == 200
        assert client.get("/v1/runs/nothing").status_code == 404
    assert httpx.post(f"{service.url}/v1/sessions/s1/turns", json={}).status_code == 401
    oversized = httpx.post(
        f"{service.url}/v1/sessions/s1/turns",
        content=b"{" + b" " * (2 * LIMIT) + b"}",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert oversized.status_code == 413
    lines = _logged(caplog, "keel.access", 4)
    fields = [r.keel for r in lines]  # type: ignore[attr-defined]
    turns = "/v1/sessions/{session_id}/turns"
    assert [(f["method"], f["route"], f["status"], f["tenant"]) for f in fields] == [
        ("POST", turns, 200, "acme"),
        ("GET", "/v1/runs/{run_id}", 404, "acme"),
        ("POST", turns, 401, None),
        ("POST", turns, 413, "acme"),
    ]
    assert fields[0]["run_id"] == reply.json()["run_id"]
    assert all(r.levelno == logging.INFO for r in lines)
    assert all(isinstance(f["duration_ms"], float) for f in fields)
    for record in lines:
        text = record.getMessage() + repr(record.__dict__)
        # The secret is all after the id: it may hold "_" itself (urlsafe base64).
        assert key not in text and key.split("_", 2)[2] not in text
        assert "Oslo" not in text


def test_a_store_failure_is_logged_at_warning_with_its_cause(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    key = _key(service)
    caplog.set_level(logging.INFO, logger="keel")
    with sqlite3.connect(service.database) as conn:
        conn.execute("DROP TABLE trace_runs")
    response = httpx.get(f"{service.url}/v1/runs", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 503
    warnings = [r for r in caplog.records if r.name == "keel.service"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "GET /v1/runs" in warnings[0].getMessage()
    assert "no such table" in warnings[0].getMessage()
    access = _logged(caplog, "keel.access", 1)
    assert [r.keel["status"] for r in access] == [503]  # type: ignore[attr-defined]


def test_a_half_sent_body_does_not_hold_a_draining_server(tmp_path: Path) -> None:
    """The issue's client, with a key this time: a turn declaring 100 bytes and sending 10.
    It never counts as in flight, and on SIGTERM the server stops once the body's deadline
    has passed (408), not when the client hangs up."""
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    backends = Backends.open(f"sqlite:///{tmp_path / 'keel.db'}", memory=False, settings=settings)
    agents = ServiceAgents(backends, ScriptedModel(lambda call: "hi"), system_prompt="Hi.")
    keys = APIKeys(backends.sql)
    drain = Drain()
    app = create_app(agents, keys, backends.traces, drain=drain, body_timeout_s=1.0)
    headers = {
        "Authorization": f"Bearer {keys.create('acme')}",
        "Content-Type": "application/json",
        "Content-Length": "100",
    }
    try:
        with serving(app, lambda config: DrainingServer(config, drain)) as running:
            raw = Raw(running.url).send(
                _head("POST", "/v1/sessions/s1/turns", headers), b"0123456789"
            )
            try:
                deadline = time.monotonic() + 30
                while not running.server.server_state.tasks:  # the request is being read
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert drain.in_flight == 0
                running.server.handle_exit(signal.SIGTERM, None)
                running.thread.join(timeout=30)
                assert not running.thread.is_alive(), "a half-sent body held the server"
                assert raw.response()[0] == 408
            finally:
                raw.close()
    finally:
        gc.unfreeze()
        backends.close()


def test_a_turn_whose_key_cannot_be_read_gets_503_not_500(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    key = _key(service)
    caplog.set_level(logging.INFO, logger="keel")
    with sqlite3.connect(service.database) as conn:
        conn.execute("DROP TABLE keel_api_keys")
    response = httpx.post(
        f"{service.url}/v1/sessions/s1/turns",
        json={"message": "book Lima", "user": "u1"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 503, response.text
    assert "keel.db" not in response.text
    warnings = _logged(caplog, "keel.service", 1)
    assert warnings and "no such table" in warnings[0].getMessage()
    assert service.booked == []
