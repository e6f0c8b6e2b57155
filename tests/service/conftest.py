"""Shared parts of the service tests: the service itself, on uvicorn over real HTTP."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.messages import Message
from keel.service import APIKeys, RateLimiter, ServiceAgents, create_app
from keel.settings import load_settings
from keel.stores import Backends
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
    agents: ServiceAgents

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    yield from _service(tmp_path, memory=False)


@pytest.fixture
def limited_service(tmp_path: Path, redis_url: str) -> Iterator[Service]:
    """The service allowing 3 requests per key and minute, counted in a real Redis, on a
    clock that stands still (no minute rolls over mid-test)."""
    limiter = RateLimiter(3, redis_url=redis_url, clock=lambda: 6_000.0)
    yield from _service(tmp_path, memory=False, rate_limiter=limiter)


@pytest.fixture
def memory_service(tmp_path: Path) -> Iterator[Service]:
    """The service with long-term memory on (the hashing embedder: fast and offline)."""
    yield from _service(tmp_path, memory=True)


def _service(
    tmp_path: Path,
    *,
    memory: bool,
    rate_limiter: RateLimiter | None = None,
    model: ScriptedModel | None = None,
    max_body_bytes: int = 10_000,
    **app_options: Any,
) -> Iterator[Service]:
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
    backends = Backends.open(f"sqlite:///{path}", memory=memory, settings=settings)
    agents = ServiceAgents(
        backends, model or ScriptedModel(_policy), system_prompt="You book trips.", tools=[book]
    )
    keys = APIKeys(backends.sql)
    app = create_app(
        agents,
        keys,
        backends.traces,
        max_body_bytes=max_body_bytes,
        metrics_token=METRICS_TOKEN,
        tenants=agents.tenants,
        rate_limiter=rate_limiter,
        ready=agents.aready,
        # The limiter's Redis client is closed on the server's loop, not left to the collector.
        on_shutdown=rate_limiter.aclose if rate_limiter is not None else None,
        **app_options,
    )
    try:
        with serving(app) as running:
            yield Service(running.url, keys, path, booked, agents)
    finally:
        backends.close()


@dataclass
class Running:
    """An app served by uvicorn in a thread of this process."""

    url: str
    server: Any
    thread: threading.Thread


@contextlib.contextmanager
def serving(app: Any, server_class: Callable[..., Any] | None = None) -> Iterator[Running]:
    """``app`` on uvicorn in a thread, on a free loopback port, stopped afterwards.
    ``server_class``: a ``uvicorn.Server`` subclass, called with the config."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = (server_class or uvicorn.Server)(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{config.port}", server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class Served:
    """A ``keel serve`` subprocess: its URL; once it stopped, its exit status and stderr."""

    url: str
    process: subprocess.Popen[str]
    stderr: str = ""
    stdout: str = ""


@contextlib.contextmanager
def keel_serve(
    *arguments: str, env: dict[str, str], cwd: Path | None = None, until_said: bool = False
) -> Iterator[Served]:
    """``keel serve ARGUMENTS`` as a subprocess on a free port (in ``cwd``), once its /health
    answers (with ``until_said``: once it printed its "listening on" line, as a script that
    waits for that line would; the line stays the first of ``stdout``); terminated (SIGTERM)
    afterwards."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "serve", "--port", str(port), *arguments],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    served = Served(f"http://127.0.0.1:{port}", process)
    said = ""
    try:
        if until_said:
            assert process.stdout is not None
            said = process.stdout.readline()  # "" once the process exits without saying it
            assert said.startswith("keel serve: listening on"), said + process.communicate()[1]
        deadline = time.monotonic() + 90
        while not until_said:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"{served.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "keel serve did not start"
            time.sleep(0.2)
        yield served
    finally:
        if process.poll() is None:
            process.terminate()
        served.stdout, served.stderr = process.communicate(timeout=60)
        served.stdout = said + served.stdout


def create_key(tenant: str, env: dict[str, str], user: str | None = None) -> str:
    """``keel keys create --tenant TENANT [--user USER]`` as a user runs it; the key it
    printed."""
    scope = [] if user is None else ["--user", user]
    created = subprocess.run(
        [sys.executable, "-m", "keel", "keys", "create", "--tenant", tenant, *scope],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    return created.stdout.strip().splitlines()[-1]
