"""Session ids on the wire and a revert against a running turn, over real HTTP.

One grammar for a session id in a path, the ``X-Keel-Session`` header and a body: the
characters ``A-Z a-z 0-9 - . _ ~ : @`` and percent-encoded UTF-8; anything else is 422 and
creates nothing. Every session ``Agent.run`` accepts stays reachable by its encoding."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.testing import ScriptedModel
from tests.service.conftest import Service, _service
from tests.service.test_ui_pages import _browser


def _chat(client: httpx.Client, headers: dict[str, Any], **body: Any) -> httpx.Response:
    request = {"model": "keel", "messages": [{"role": "user", "content": "Book Oslo"}], **body}
    return client.post("/v1/chat/completions", json=request, headers=headers)


def test_a_session_id_outside_the_grammar_is_422_and_creates_nothing(service: Service) -> None:
    with service.client(service.keys.create("acme")) as acme:
        for spelled in ("team/alpha", "café".encode(), "a b", "50%", "%ZZ", "%C3"):
            headers = {"X-Keel-Session": spelled, "X-Keel-User": "u1"}
            answer = _chat(acme, headers)
            assert answer.status_code == 422, (spelled, answer.text)
            # The chat route answers in OpenAI's error shape (keel's kind is its code).
            assert answer.json()["error"]["code"] == "validation_error"
        in_body = _chat(acme, {}, metadata={"session_id": "team/alpha", "user_id": "u1"})
        assert in_body.status_code == 422
        assert _chat(acme, {"X-Keel-Session": "s1", "X-Keel-User": "café".encode()}).is_error
        assert acme.get("/v1/runs").json() == []
    assert service.booked == []


def test_a_session_is_the_same_one_by_its_encoding_in_path_header_and_body(
    service: Service,
) -> None:
    with service.client(service.keys.create("acme")) as acme:
        chat = _chat(acme, {"X-Keel-Session": "caf%C3%A9", "X-Keel-User": "u1"})
        assert chat.status_code == 200, chat.text
        session = acme.get("/v1/sessions/caf%C3%A9")
        assert session.status_code == 200 and session.json()["session_id"] == "café"
        turn = acme.post(
            "/v1/sessions/caf%C3%A9/turns", json={"message": "Book Rome", "user": "u1"}
        ).json()
        meta = {"session_id": "caf%C3%A9", "user_id": "u1"}
        again = _chat(acme, {}, metadata=meta, messages=[{"role": "user", "content": "Book Lima"}])
        assert again.status_code == 200, again.text
        assert acme.get("/v1/sessions/caf%C3%A9").json()["version"] > turn["state_version"]
        assert acme.get("/v1/sessions/caf%C3%83%C2%A9").status_code == 404, "read as Latin-1"
    assert service.booked == ["Oslo", "Rome", "Lima"]


def test_a_session_agent_run_made_outside_the_grammar_is_reachable_by_its_encoding(
    service: Service,
) -> None:
    agent = service.agents("acme")
    for session in ("team/alpha", "50% off", "x/checkpoints"):
        reply = agent.run_sync("Book Oslo", session=session, user="u1")
        assert reply.status == "completed"
    with service.client(service.keys.create("acme")) as acme:
        for spelled, session in (("team%2Falpha", "team/alpha"), ("50%25%20off", "50% off")):
            found = acme.get(f"/v1/sessions/{spelled}")
            assert found.status_code == 200 and found.json()["session_id"] == session
            assert acme.get(f"/v1/sessions/{spelled}/checkpoints").status_code == 200
            turn = acme.post(
                f"/v1/sessions/{spelled}/turns", json={"message": "Book Rio", "user": "u1"}
            )
            assert turn.json()["session_id"] == session
        # A session named like another's sub-resource is still that session.
        state = acme.get("/v1/sessions/x%2Fcheckpoints").json()
        assert state["session_id"] == "x/checkpoints" and state["version"] >= 1
        assert acme.get("/v1/sessions/team/alpha").status_code == 404


class _GatedModel(ScriptedModel):
    """Echoes; while ``gate`` is clear, a call says it started and waits for it (on the loop)."""

    def __init__(self) -> None:
        super().__init__(lambda call: f"echo: {call.last_user_text}")
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    async def _acomplete(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        deadline = time.monotonic() + 60
        while not self.gate.is_set():
            assert time.monotonic() < deadline, "the test never opened the gate"
            await asyncio.sleep(0.01)
        return await super()._acomplete(*args, **kwargs)


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[Service, _GatedModel]]:
    model = _GatedModel()
    for running in _service(tmp_path, memory=False, model=model):
        yield running, model


def test_a_revert_while_a_turn_runs_is_409_busy_and_the_turn_commits(
    gated: tuple[Service, _GatedModel],
) -> None:
    service, model = gated
    key = service.keys.create("acme")
    with service.client(key) as acme:
        body = {"message": "first", "user": "u1"}
        first = acme.post("/v1/sessions/s1/turns", json=body).json()
        model.gate.clear()
        model.started.clear()
        answers: list[httpx.Response] = []

        def second_turn() -> None:
            with service.client(key) as client:
                body = {"message": "second", "user": "u1"}
                answers.append(client.post("/v1/sessions/s1/turns", json=body))

        running = threading.Thread(target=second_turn)
        running.start()
        assert model.started.wait(30), "the second turn never reached the model"
        revert = {"version": 1, "expected_version": first["state_version"]}
        refused = acme.post("/v1/sessions/s1/revert", json=revert)
        with _browser(service, key) as page:  # the viewer's revert takes the lease too
            form = {"version": 1, "expected_version": first["state_version"], "confirm": "yes"}
            viewed = page.post("/ui/sessions/s1/revert", data=form)
        model.gate.set()
        assert "A turn is running on this session: nothing was reverted" in viewed.text
        running.join(30)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["type"] == "SessionBusyError"
        second = answers[0].json()
        assert answers[0].status_code == 200 and second["text"] == "echo: second"
        session = acme.get("/v1/sessions/s1").json()
        assert session["version"] == second["state_version"]
        texts = [m["content"] for m in session["state"]["messages"]]
        assert texts == ["first", "echo: first", "second", "echo: second"]
        # Once the turn is done, the same revert goes through.
        revert["expected_version"] = second["state_version"]
        assert acme.post("/v1/sessions/s1/revert", json=revert).status_code == 200
