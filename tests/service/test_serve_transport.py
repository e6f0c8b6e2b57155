"""``keel serve`` as a process, at the transport: secrets out of its arguments, headers within
a deadline, JSON access lines, and a drain on SIGTERM that is the same with one worker or
several (503 with Retry-After to new requests, the turns in flight finished)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.conftest import create_key, keel_serve


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    environment = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }
    environment.pop("KEEL_METRICS_TOKEN", None)
    return environment


def test_the_metrics_token_never_shows_in_the_arguments(
    tmp_path: Path, env: dict[str, str]
) -> None:
    token = "a-metrics-secret-7f3a"
    refused = subprocess.run(
        [sys.executable, "-m", "keel", "serve", "--metrics-token", token],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode != 0 and "KEEL_METRICS_TOKEN" in refused.stderr
    token_file = tmp_path / "metrics-token"
    token_file.write_text(token + "\n")
    arguments = ("--model", "scripted:echo", "--no-memory", "--metrics-token-file", str(token_file))
    with keel_serve(*arguments, env=env) as served:
        command_line = Path(f"/proc/{served.process.pid}/cmdline").read_bytes()
        assert token.encode() not in command_line
        metrics = httpx.get(
            f"{served.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        assert metrics.status_code == 200 and "keel_http_requests_total" in metrics.text
    with keel_serve(
        "--model", "scripted:echo", "--no-memory", env={**env, "KEEL_METRICS_TOKEN": token}
    ) as served:
        metrics = httpx.get(
            f"{served.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        assert metrics.status_code == 200


def test_late_headers_close_the_connection_and_access_lines_are_json(
    env: dict[str, str],
) -> None:
    key = create_key("acme", env)
    arguments = ("--model", "scripted:echo", "--no-memory", "--header-timeout", "1")
    with keel_serve(*arguments, "--log-format", "json", env=env) as served:
        port = int(served.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
            slow.sendall(b"POST /v1/sessions/s1/turns HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            try:
                closed = slow.recv(1024) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
            assert closed, "a connection whose headers never end is kept open"
        reply = httpx.post(
            f"{served.url}/v1/sessions/s1/turns",
            json={"message": "hello there", "user": "u1"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert reply.status_code == 200
    lines = [json.loads(line) for line in served.stderr.splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "keel.access"]
    turn = [line for line in access if line["route"] == "/v1/sessions/{session_id}/turns"]
    assert len(turn) == 1, served.stderr
    assert turn[0]["level"] == "INFO" and turn[0]["method"] == "POST"
    assert turn[0]["status"] == 200 and turn[0]["tenant"] == "acme"
    assert turn[0]["run_id"] == reply.json()["run_id"]
    assert key not in served.stderr and "hello there" not in served.stderr


class _HeldModel:
    """An OpenAI-compatible model server whose replies wait until the test releases them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()
        held = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with held._lock:
                    held.waiting += 1
                held.release.wait(timeout=120)
                self.send_response(200)
                if request.get("stream"):
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for chunk in held.chunks():
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                body = json.dumps(held.completion()).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @staticmethod
    def completion() -> dict[str, Any]:
        return {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": "held",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "finished"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }

    @staticmethod
    def chunks() -> list[dict[str, Any]]:
        base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "held"}
        return [
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "finished"},
                        "finish_reason": None,
                    }
                ],
            },
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {
                **base,
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            },
        ]


@pytest.fixture
def held_model() -> Iterator[_HeldModel]:
    model = _HeldModel()
    thread = threading.Thread(target=model.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield model
    finally:
        model.release.set()
        model.server.shutdown()
        model.server.server_close()


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_drains_the_same_with_any_number_of_workers(
    env: dict[str, str], held_model: _HeldModel, workers: int
) -> None:
    """Two turns wait on the model when SIGTERM comes. Every request after it is answered
    (never left hanging in the listening socket's backlog): 503 with Retry-After once the
    worker drains; the two turns finish; then the server exits."""
    key = create_key("acme", env)
    headers = {"Authorization": f"Bearer {key}"}
    arguments = ("--model", f"openai-compatible:held@{held_model.url}", "--no-memory")
    with (
        keel_serve(*arguments, "--workers", str(workers), env=env) as served,
        ThreadPoolExecutor(2) as pool,
    ):

        def turn(session: str) -> httpx.Response:
            body = {"message": f"hold {session}", "user": "u1"}
            return httpx.post(
                f"{served.url}/v1/sessions/{session}/turns", json=body, headers=headers, timeout=120
            )

        in_flight: list[Future[httpx.Response]] = [pool.submit(turn, s) for s in ("a", "b")]
        deadline = time.monotonic() + 60
        while held_model.waiting < 2:
            assert time.monotonic() < deadline, "the turns never reached the model"
            time.sleep(0.02)
        served.process.send_signal(signal.SIGTERM)
        statuses = []
        while time.monotonic() < deadline:
            try:
                # A fresh connection each time: a new client, not a kept-alive one.
                response = httpx.get(f"{served.url}/v1/runs", headers=headers, timeout=20)
            except httpx.TransportError as exc:
                pytest.fail(f"a request during the drain was dropped: {exc!r} after {statuses}")
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.json()["error"]["type"] == "Draining"
                assert int(response.headers["Retry-After"]) >= 1
                break
        assert statuses[-1] == 503, statuses
        if workers == 1:  # (with two, the other worker may take it just before its SIGTERM)
            refused = httpx.post(
                f"{served.url}/v1/sessions/c/turns",
                json={"message": "new", "user": "u1"},
                headers=headers,
                timeout=20,
            )
            assert refused.status_code == 503 and refused.headers["Retry-After"]
        held_model.release.set()
        finished = [future.result(timeout=60) for future in in_flight]
        assert [r.status_code for r in finished] == [200, 200]
        assert [r.json()["text"] for r in finished] == ["finished", "finished"]
        # Drained, then stopped cleanly: exit 0 with one worker as with several.
        assert served.process.wait(timeout=60) == 0
