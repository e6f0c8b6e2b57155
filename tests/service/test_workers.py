"""``keel serve --workers 2`` on PostgreSQL + Redis (real servers): two worker processes, one
database; concurrent turns on one session all land, each exactly once, whichever worker ran it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from keel.testing.servers import free_port


def test_two_workers_serve_one_session_without_losing_or_repeating_a_turn(
    tmp_path: Path, postgres_url: str, redis_server_url: str
) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": postgres_url,
        "KEEL_REDIS_URL": redis_server_url,
    }
    keel = [sys.executable, "-m", "keel"]
    created = subprocess.run(
        [*keel, "keys", "create", "--tenant", "acme"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    port = free_port()
    server = subprocess.Popen(
        [*keel, "serve", "--port", str(port), "--workers", "2", "--model", "scripted:echo",
         "--no-memory"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "keel serve --workers 2 did not start"
            time.sleep(0.2)

        def send(n: int) -> int:
            body = {"message": f"message {n}", "user": "u1"}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                return client.post("/v1/sessions/shared/turns", json=body).status_code

        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(send, range(16)))
        assert statuses == [200] * 16, statuses
        state = httpx.get(f"{url}/v1/sessions/shared", headers=headers, timeout=30).json()
        users = sorted(m["content"] for m in state["state"]["messages"] if m["role"] == "user")
        assert users == sorted(f"message {n}" for n in range(16)), "a turn was lost or repeated"
        assert state["state"]["runtime"]["open_turn"] is None
    finally:
        server.terminate()
        server.communicate(timeout=60)
