"""Graceful drain over real HTTP: on the first SIGTERM a turn in flight finishes, a new one is
refused with 503 and Retry-After, and the server stops once the turn is done."""

from __future__ import annotations

import gc
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.service import APIKeys, Drain, DrainingServer, ServiceAgents, create_app
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from tests.service.conftest import serving


def test_sigterm_drains_the_turns_in_flight_and_refuses_new_ones(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    backends = Backends.open(f"sqlite:///{tmp_path / 'keel.db'}", memory=False, settings=settings)
    model = ScriptedModel(lambda call: f"echo: {call.last_user_text}", delay_s=1.0)
    agents = ServiceAgents(backends, model, system_prompt="You echo.")
    keys = APIKeys(backends.sql)
    drain = Drain()
    app = create_app(agents, keys, backends.traces, drain=drain, ready=agents.aready)
    headers = {"Authorization": f"Bearer {keys.create('acme')}"}
    results: dict[str, httpx.Response] = {}
    try:
        with serving(app, lambda config: DrainingServer(config, drain)) as running:
            url = running.url
            # Started, it set its start-up heap aside from the collector (undone below: this
            # process is the test run, not a server).
            assert gc.get_freeze_count() > 0
            assert httpx.get(f"{url}/ready", timeout=5).json() == {"status": "ready"}

            def slow_turn() -> None:
                body = {"message": "in flight", "user": "u1"}
                results["slow"] = httpx.post(
                    f"{url}/v1/sessions/s1/turns", json=body, headers=headers, timeout=30
                )

            turn = threading.Thread(target=slow_turn)
            turn.start()
            while drain.in_flight == 0:
                time.sleep(0.01)
            running.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
            refused = httpx.post(
                f"{url}/v1/sessions/s2/turns",
                json={"message": "new", "user": "u1"},
                headers=headers,
                timeout=10,
            )
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "Draining"
            assert refused.headers["Retry-After"] == "1"
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200, "stopped too early"
            # A load balancer's readiness probe sees it go, while it still lives.
            not_ready = httpx.get(f"{url}/ready", timeout=5)
            assert not_ready.status_code == 503 and not_ready.json()["error"]["type"] == "Draining"
            turn.join(timeout=30)
            assert results["slow"].status_code == 200
            assert results["slow"].json()["text"] == "echo: in flight"
            running.thread.join(timeout=30)
            assert not running.thread.is_alive(), "the server did not stop once drained"
    finally:
        gc.unfreeze()
        backends.close()


def test_a_streamed_turn_counts_as_in_flight_until_its_last_event_is_sent(
    tmp_path: Path,
) -> None:
    """A streamed turn runs while its body is sent, after its response has started: a drain
    that stopped counting it at the headers would stop the server under it."""
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    backends = Backends.open(f"sqlite:///{tmp_path / 'keel.db'}", memory=False, settings=settings)
    model = ScriptedModel(lambda call: f"echo: {call.last_user_text}", delay_s=1.0)
    agents = ServiceAgents(backends, model, system_prompt="You echo.")
    keys = APIKeys(backends.sql)
    drain = Drain()
    app = create_app(agents, keys, backends.traces, drain=drain)
    headers = {"Authorization": f"Bearer {keys.create('acme')}", "Accept": "text/event-stream"}
    try:
        with serving(app, lambda config: DrainingServer(config, drain)) as running:
            body = {"message": "streamed", "user": "u1"}
            with httpx.stream(
                "POST", f"{running.url}/v1/sessions/s1/turns", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                # The headers are out; the model still thinks for a second.
                assert drain.in_flight == 1
                events = [line for line in response.iter_lines() if line.startswith("data:")]
            assert events and "echo: streamed" in events[-1]
            deadline = time.monotonic() + 10
            while drain.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert drain.in_flight == 0
    finally:
        gc.unfreeze()
        backends.close()


def test_a_worker_builds_its_server_before_the_health_check_thread_can_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both threads reaching the lazy property at once could each build a server: the pings
    # would then read one that never starts. Forced: the health-check thread is recorded,
    # not run, and must find the server the worker runs already built.
    from uvicorn import Config
    from uvicorn.supervisors import multiprocess

    from keel.service import _drain

    ran: list[object] = []
    seen_by_thread: list[object] = []

    class RecordedThread:
        def __init__(self, target: Any, daemon: bool) -> None:
            self.owner = target.__self__

        def start(self) -> None:
            seen_by_thread.append(self.owner.__dict__.get("_server"))

    monkeypatch.setattr(multiprocess.threading, "Thread", RecordedThread)
    monkeypatch.setattr(
        _drain.DrainingServer, "run", lambda server, sockets=None: ran.append(server)
    )
    worker = _drain._DrainingProcess(Config(app=lambda scope: None), sockets=[])
    worker.target(sockets=None)
    assert seen_by_thread and seen_by_thread[0] is not None
    assert ran == seen_by_thread
