"""Users within a tenant, over real HTTP: a key names its tenant and optionally one user; a
user key reaches only that user's sessions, memory and runs; a tenant-wide key is the tenant's
operator key, listed so by ``keel keys list``, and its reads of a user's data are logged."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import Service


def _turn(client: httpx.Client, session: str, text: str, user: str) -> httpx.Response:
    return client.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": user})


def test_a_user_key_reaches_only_its_users_sessions_memory_and_runs(
    memory_service: Service,
) -> None:
    service = memory_service
    keys = service.keys
    with (
        service.client(keys.create("acme", "ada")) as ada,
        service.client(keys.create("acme", "bob")) as bob,
    ):
        assert _turn(ada, "s-ada", "Book Oslo", "ada").status_code == 200
        bobs_turn = _turn(bob, "s-bob", "Book Lima", "bob").json()
        note = bob.post("/v1/memory", json={"user": "bob", "text": "Bob's dog is Rex"}).json()
        # Acting as another user is refused; reading another user's data is as if absent.
        assert _turn(ada, "s-bob", "Book Rome", "bob").status_code == 403
        assert _turn(ada, "s-new", "Book Rome", "bob").status_code == 403
        assert ada.get("/v1/sessions/s-bob").status_code == 404
        assert ada.get("/v1/sessions/s-bob/checkpoints").status_code == 404
        assert ada.get("/v1/sessions/s-bob/in-doubt").status_code == 404
        revert = {"version": 1, "expected_version": bobs_turn["state_version"]}
        assert ada.post("/v1/sessions/s-bob/revert", json=revert).status_code == 404
        assert ada.get(f"/v1/runs/{bobs_turn['run_id']}").status_code == 404
        assert [run["user_id"] for run in ada.get("/v1/runs").json()] == ["ada"]
        search = {"user": "bob", "q": "dog Rex"}
        assert ada.get("/v1/memory/search", params=search).status_code == 403
        assert ada.post("/v1/memory", json={"user": "bob", "text": "x"}).status_code == 403
        forget = ada.delete(f"/v1/memory/{note['id']}", params={"user": "bob"})
        assert forget.status_code == 403
        chat = {"model": "keel", "messages": [{"role": "user", "content": "Book Rome"}]}
        as_bob = {"X-Keel-Session": "s-bob", "X-Keel-User": "bob"}
        assert ada.post("/v1/chat/completions", json=chat, headers=as_bob).status_code == 403
        # Nothing of Bob's changed.
        assert bob.get("/v1/sessions/s-bob").json()["version"] == bobs_turn["state_version"]
        hits = bob.get("/v1/memory/search", params=search).json()
        assert [hit["record"]["id"] for hit in hits][:1] == [note["id"]]
    assert service.booked == ["Oslo", "Lima"]


def test_the_operator_key_reaches_every_user_and_its_reads_are_logged(
    memory_service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    service = memory_service
    with (
        service.client(service.keys.create("acme", "bob")) as bob,
        service.client(service.keys.create("acme")) as operator,
    ):
        reply = _turn(bob, "s-bob", "Book Lima", "bob").json()
        with caplog.at_level(logging.INFO, logger="keel.service.access"):
            assert operator.get("/v1/sessions/s-bob").status_code == 200
            assert operator.get(f"/v1/runs/{reply['run_id']}").status_code == 200
            search = {"user": "bob", "q": "Lima"}
            assert operator.get("/v1/memory/search", params=search).status_code == 200
    reads = [r for r in caplog.records if r.name == "keel.service.access"]
    assert [getattr(r, "of_user", None) for r in reads] == ["bob", "bob", "bob"]
    assert all(r.levelno == logging.INFO and "keel_" not in r.getMessage() for r in reads)


def test_keys_list_says_which_key_is_an_operators(tmp_path: Path) -> None:
    env = {**os.environ, "KEEL_DATA_DIR": str(tmp_path / "data")}

    def keel(*arguments: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "keel", "keys", *arguments],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    keel("create", "--tenant", "acme")
    keel("create", "--tenant", "acme", "--user", "ada")
    listed = json.loads(keel("list", "--json"))["keys"]
    assert sorted((k["scope"], k["user"]) for k in listed) == [
        ("operator", None),
        ("user:ada", "ada"),
    ]
    assert sorted(line.split()[2] for line in keel("list").splitlines()) == [
        "operator",
        "user:ada",
    ]


def test_the_viewer_signs_in_only_an_operator_key(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as browser:
        for key, status in (
            (service.keys.create("acme", "ada"), 401),
            (service.keys.create("acme"), 303),
        ):
            answer = browser.post("/ui/login", data={"key": key, "next": "/ui/runs"})
            assert answer.status_code == status, answer.text


def test_a_user_key_need_not_name_its_user_in_a_turn(service: Service) -> None:
    """The key already names the user: its turn's body was refused without ``user``, as the
    OpenAI route, which takes the user from the key, never did."""
    with (
        service.client(service.keys.create("acme", "ada")) as ada,
        service.client(service.keys.create("acme")) as operator,
    ):
        turn = ada.post("/v1/sessions/s1/turns", json={"message": "Book Oslo"})
        assert turn.status_code == 200, turn.text
        assert ada.get("/v1/sessions/s1").status_code == 200  # hers
        unnamed = operator.post("/v1/sessions/s2/turns", json={"message": "Book Oslo"})
        assert unnamed.status_code == 422 and "user:" in unnamed.json()["error"]["message"]
        named = operator.post("/v1/sessions/s2/turns", json={"message": "Book Rome", "user": "bob"})
        assert named.status_code == 200, named.text
