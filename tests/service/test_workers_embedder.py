"""``keel serve`` with memory on (the bundled MiniLM embedder, on SQLite): a worker loads its
embedder while it starts, before it answers any request, so that no turn of a (re)started
worker waits for the model."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.service.conftest import create_key, keel_serve


def test_a_worker_loads_its_embedder_before_it_answers_a_request(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }
    env.pop("KEEL_EMBEDDER", None)  # the default: all-MiniLM-L6-v2 on ONNX Runtime
    headers = {"Authorization": f"Bearer {create_key('acme', env)}"}
    with keel_serve("--model", "scripted:echo", env=env) as served:
        turn = httpx.post(
            f"{served.url}/v1/sessions/s1/turns",
            json={"message": "I live in Oslo", "user": "u1"},
            headers=headers,
            timeout=60,
        )
        assert turn.status_code == 200, turn.text
    lines = served.stderr.splitlines()
    loaded = [n for n, line in enumerate(lines) if "embedder all-MiniLM-L6-v2 loaded" in line]
    answered = [n for n, line in enumerate(lines) if "keel.access" in line]
    assert len(loaded) == 1, served.stderr
    # keel_serve polled /health until it answered: every answer came after the model loaded.
    assert answered and loaded[0] < answered[0], served.stderr
