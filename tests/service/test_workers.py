"""``keel serve --workers 2`` on PostgreSQL + Redis (real servers): two worker processes, one
database; concurrent turns on one session all land, each exactly once, whichever worker ran it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.service.conftest import create_key, keel_serve


def test_two_workers_serve_one_session_without_losing_or_repeating_a_turn(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": postgres_url,
        "KEEL_REDIS_URL": redis_url,
    }
    headers = {"Authorization": f"Bearer {create_key('acme', env)}"}
    arguments = ("--workers", "2", "--model", "scripted:echo", "--no-memory")
    with keel_serve(*arguments, env=env) as served:

        def send(n: int) -> int:
            body = {"message": f"message {n}", "user": "u1"}
            with httpx.Client(base_url=served.url, headers=headers, timeout=60) as client:
                return client.post("/v1/sessions/shared/turns", json=body).status_code

        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(send, range(16)))
        assert statuses == [200] * 16, statuses
        state = httpx.get(f"{served.url}/v1/sessions/shared", headers=headers, timeout=30).json()
        users = sorted(m["content"] for m in state["state"]["messages"] if m["role"] == "user")
        assert users == sorted(f"message {n}" for n in range(16)), "a turn was lost or repeated"
        assert state["state"]["runtime"]["open_turn"] is None
