"""``keel keys create`` and ``keel serve`` as a user runs them: real subprocesses, real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from keel.testing.servers import free_port


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "KEEL_DATA_DIR": str(tmp_path / "data"), "KEEL_EMBEDDER": "hashing:64"}


def test_keys_create_then_serve_answers_that_tenant(tmp_path: Path) -> None:
    env = _env(tmp_path)
    created = subprocess.run(
        [sys.executable, "-m", "keel", "keys", "create", "--tenant", "acme"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("keel_")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "keel", "serve", "--port", str(port),
            "--model", "scripted:echo", "--no-memory",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "keel serve did not start"
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {key}"}
        reply = httpx.post(
            f"{url}/v1/sessions/s1/turns",
            json={"message": "hello there", "user": "u1"},
            headers=headers,
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["text"] == "hello there"
        schema = httpx.get(f"{url}/openapi.json", timeout=5).json()
        assert "/v1/sessions/{session_id}/turns" in schema["paths"]
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (exit status -15).
    assert server.returncode in (0, -15), stderr
    assert "Traceback" not in stderr, stderr
