"""Shared parts of the service tests: the service itself, on uvicorn over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from keel.messages import Message
from keel.runtime import open_backends
from keel.service import APIKeys, RateLimiter, ServiceAgents, create_app
from keel.service._serve import sql_database
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.testing.servers import free_port
from keel.tools import tool

EMAIL = "ada@example.com"
METRICS_TOKEN = "operator-token"


def _policy(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role == "tool":
        return f"Booked: {last.content}. I will write to {EMAIL}."
    return ScriptedModel.tool_call("book", json.dumps({"city": call.last_user_text.split()[-1]}))


@dataclass
class Service:
    url: str
    keys: APIKeys
    database: Path
    booked: list[str]

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    yield from _service(tmp_path, memory=False)


@pytest.fixture
def limited_service(tmp_path: Path, redis_server_url: str) -> Iterator[Service]:
    """The service allowing 3 requests per key and minute, counted in a real Redis, on a
    clock that stands still (no minute rolls over mid-test)."""
    limiter = RateLimiter(3, redis_url=redis_server_url, clock=lambda: 6_000.0)
    yield from _service(tmp_path, memory=False, rate_limiter=limiter)


@pytest.fixture
def memory_service(tmp_path: Path) -> Iterator[Service]:
    """The service with long-term memory on (the hashing embedder: fast and offline)."""
    yield from _service(tmp_path, memory=True)


def _service(
    tmp_path: Path, *, memory: bool, rate_limiter: RateLimiter | None = None
) -> Iterator[Service]:
    import uvicorn

    from keel.privacy import PIIMasker

    booked: list[str] = []

    @tool(side_effect=True, idempotent=False)
    def book(city: str) -> str:
        """Book a trip.

        Args:
            city: Where to.
        """
        booked.append(city)
        return f"trip to {city}"

    path = tmp_path / "keel.db"
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    backends = open_backends(
        f"sqlite:///{path}", memory=memory, masker=PIIMasker(), settings=settings
    )
    agents = ServiceAgents(
        backends, ScriptedModel(_policy), system_prompt="You book trips.", tools=[book]
    )
    keys = APIKeys(sql_database(backends))
    app = create_app(
        agents,
        keys,
        backends.traces,
        max_body_bytes=10_000,
        metrics_token=METRICS_TOKEN,
        tenants=agents.tenants,
        rate_limiter=rate_limiter,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Service(f"http://127.0.0.1:{port}", keys, path, booked)
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        backends.close()
