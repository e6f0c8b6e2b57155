"""``keel serve`` with memory on (on SQLite): a worker loads its embedder while it starts,
before it answers any request, so that no turn of a (re)started worker waits for the model;
and the command says "listening on" only then, once every worker can answer a turn."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import Served, create_key, keel_serve


def _turn_the_instant_it_says_listening(served: Served, headers: dict[str, str]) -> None:
    try:
        turn = httpx.post(
            f"{served.url}/v1/sessions/s1/turns",
            json={"message": "I live in Oslo", "user": "u1"},
            headers=headers,
            timeout=60,
        )
    except httpx.TransportError as exc:
        pytest.fail(f"keel serve said 'listening on' before it took traffic: {exc!r}")
    assert turn.status_code == 200, turn.text


def test_a_worker_loads_its_embedder_before_it_answers_a_request(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }
    env.pop("KEEL_EMBEDDER", None)  # the default: all-MiniLM-L6-v2 on ONNX Runtime
    headers = {"Authorization": f"Bearer {create_key('acme', env)}"}
    with keel_serve("--model", "scripted:echo", env=env, until_said=True) as served:
        _turn_the_instant_it_says_listening(served, headers)
    lines = served.stderr.splitlines()
    loaded = [n for n, line in enumerate(lines) if "embedder all-MiniLM-L6-v2 loaded" in line]
    answered = [n for n, line in enumerate(lines) if "keel.access" in line]
    assert len(loaded) == 1, served.stderr
    # The turn was sent the instant keel serve said "listening on": it came after the load.
    assert answered and loaded[0] < answered[0], served.stderr


def test_with_two_workers_listening_is_said_once_both_loaded_their_embedder(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }
    env.pop("KEEL_EMBEDDER", None)  # the default: each worker's start-up loads a model
    headers = {"Authorization": f"Bearer {create_key('acme', env)}"}
    arguments = ("--workers", "2", "--model", "scripted:echo")
    with keel_serve(*arguments, env=env, until_said=True) as served:
        _turn_the_instant_it_says_listening(served, headers)
    assert served.stdout.startswith(f"keel serve: listening on {served.url} "), served.stdout
    lines = served.stderr.splitlines()
    loaded = [n for n, line in enumerate(lines) if "embedder all-MiniLM-L6-v2 loaded" in line]
    answered = [n for n, line in enumerate(lines) if "keel.access" in line]
    # Not only the first worker: a turn sent then could queue behind one still loading.
    assert len(loaded) == 2 and answered and loaded[1] < answered[0], served.stderr
