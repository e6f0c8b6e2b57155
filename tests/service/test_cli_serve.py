"""``keel keys create`` and ``keel serve`` as a user runs them: real subprocesses, real HTTP."""

from __future__ import annotations

import gc
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import create_key, keel_serve


def test_keys_create_then_serve_answers_that_tenant(tmp_path: Path) -> None:
    env = {**os.environ, "KEEL_DATA_DIR": str(tmp_path / "data"), "KEEL_EMBEDDER": "hashing:64"}
    key = create_key("acme", env)
    assert key.startswith("keel_")
    with keel_serve("--model", "scripted:echo", "--no-memory", env=env) as served:
        reply = httpx.post(
            f"{served.url}/v1/sessions/s1/turns",
            json={"message": "hello there", "user": "u1"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["text"] == "hello there"
        schema = httpx.get(f"{served.url}/openapi.json", timeout=5).json()
        assert "/v1/sessions/{session_id}/turns" in schema["paths"]
    # Stopped by SIGTERM (`keel_serve` on leaving), drained, then a clean exit.
    assert served.process.returncode == 0, served.stderr
    assert "Traceback" not in served.stderr, served.stderr


def test_each_uvicorn_worker_builds_its_service_and_freezes_its_start_up_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fastapi.testclient import TestClient

    from keel.service._factory import SERVE_ENV, create

    monkeypatch.setenv(SERVE_ENV, json.dumps({"model": "scripted:echo", "memory": False}))
    try:
        app = create()
        # What `keel serve --workers N` runs in each worker process, here in the test run.
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    with TestClient(app) as client:  # start-up warms the stores, shut-down closes them
        assert client.get("/ready").json() == {"status": "ready"}


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda stop: stop.name)
def test_one_worker_stopped_by_a_signal_exits_cleanly(tmp_path: Path, stop: int) -> None:
    """Ctrl-C or a supervisor's SIGTERM: drained, then exit 0 (not killed by the signal
    uvicorn raises again, nor a KeyboardInterrupt), as with several workers."""
    env = {**os.environ, "KEEL_DATA_DIR": str(tmp_path / "data"), "KEEL_EMBEDDER": "hashing:64"}
    with keel_serve("--model", "scripted:echo", "--no-memory", env=env) as served:
        served.process.send_signal(stop)
        assert served.process.wait(timeout=60) == 0
    assert "Traceback" not in served.stderr and "KeyboardInterrupt" not in served.stderr
