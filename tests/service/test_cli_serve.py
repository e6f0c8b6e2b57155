"""``keel keys create`` and ``keel serve`` as a user runs them: real subprocesses, real HTTP."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

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
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (exit status -15).
    assert served.process.returncode in (0, -15), served.stderr
    assert "Traceback" not in served.stderr, served.stderr
