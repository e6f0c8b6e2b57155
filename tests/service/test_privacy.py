"""The PII vault over HTTP: tools get values, a user key reads its own values, an operator
key placeholders (values only when the deployment grants them), and an operator's
``POST /v1/privacy/forget``; every request real HTTP to uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.messages import Message
from keel.privacy import PLACEHOLDER, MasterKey
from keel.service import APIKeys, build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.service.conftest import Service, serving

ADA_EMAIL = "ada.lovelace@example.com"
BOB_EMAIL = "bob.babbage@example.org"


def _newest(call: ScriptedCall, kind: str) -> str:
    """The newest placeholder of ``kind`` the model was shown (in user and tool messages)."""
    seen = "\n".join(m.content for m in call.messages if m.role in ("user", "tool"))
    found = [m.group(0) for m in PLACEHOLDER.finditer(seen) if m.group(1) == kind]
    return found[-1] if found else f"<{kind}_?>"


def _receipt_policy(call: ScriptedCall) -> Message | str:
    """Answers with what it was shown; asked for a receipt, sends it to the newest email."""
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}"
    if "receipt" in call.last_user_text:
        arguments = json.dumps({"email": _newest(call, "EMAIL")})
        return ScriptedModel.tool_call("send_receipt", arguments)
    return f"Noted: {call.last_user_text}"


@dataclass
class VaultService:
    url: str
    keys: APIKeys
    sent: list[str]

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )


def _vault_service(
    database: str, tmp_path: Path, *, operators_see_values: bool = False, memory: bool = False
) -> Iterator[VaultService]:
    sent: list[str] = []

    @tool(side_effect=True, idempotent=False)
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to.
        """
        sent.append(email)
        return f"receipt sent to {email}"

    settings = load_settings(
        data_dir=tmp_path, embedder="hashing:64", pii_key=MasterKey.new_key_text()
    )
    app, agents, keys = build_service(
        database,
        model=ScriptedModel(_receipt_policy),
        tools=[send_receipt],
        memory=memory,
        operators_see_values=operators_see_values,
        settings=settings,
    )
    assert agents.backends.vault is not None
    # On exit the server's lifespan closes the agents' stores.
    with serving(app) as running:
        yield VaultService(running.url, keys, sent)


@pytest.fixture
def vault_service(tmp_path: Path) -> Iterator[VaultService]:
    yield from _vault_service(f"sqlite:///{tmp_path / 'keel.db'}", tmp_path)


def _turn(client: httpx.Client, session: str, user: str, text: str) -> dict[str, Any]:
    response = client.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": user})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _history(client: httpx.Client, session: str, run_id: str) -> str:
    """Everything a key reads of a session's history: its state, its runs, one run whole."""
    state = client.get(f"/v1/sessions/{session}")
    runs = client.get("/v1/runs", params={"session": session})
    run = client.get(f"/v1/runs/{run_id}")
    assert state.status_code == runs.status_code == run.status_code == 200
    return json.dumps([state.json(), runs.json(), run.json()])


def test_a_tool_gets_over_http_the_email_given_two_turns_earlier(
    vault_service: VaultService,
) -> None:
    service = vault_service
    with service.client(service.keys.create("acme", "ada")) as ada:
        _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}")
        _turn(ada, "s-ada", "ada", "Nice weather today")
        reply = _turn(ada, "s-ada", "ada", "Please send my receipt")
    assert service.sent == [ADA_EMAIL]
    # The reply the user's key gets shows the user's value.
    assert reply["text"] == f"Done: receipt sent to {ADA_EMAIL}"


def test_streamed_turns_and_chat_completions_show_the_user_their_values(
    vault_service: VaultService,
) -> None:
    service = vault_service
    with service.client(service.keys.create("acme", "ada")) as ada:
        _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}")
        streamed = ada.post(
            "/v1/sessions/s-ada/turns",
            json={"message": "Please send my receipt", "user": "ada"},
            headers={"Accept": "text/event-stream"},
        )
        events = [
            json.loads(line[len("data: ") :])
            for line in streamed.text.splitlines()
            if line.startswith("data: ")
        ]
        text = "".join(event["text"] for event in events if event["type"] == "text")
        assert text == f"Done: receipt sent to {ADA_EMAIL}"
        assert events[-1]["reply"]["text"] == text
        chat = {"model": "keel", "messages": [{"role": "user", "content": "Send my receipt"}]}
        headers = {"X-Keel-Session": "s-ada", "X-Keel-User": "ada"}
        completion = ada.post("/v1/chat/completions", json=chat, headers=headers)
        assert completion.status_code == 200, completion.text
        answer = completion.json()["choices"][0]["message"]["content"]
        assert answer == f"Done: receipt sent to {ADA_EMAIL}"
    assert service.sent == [ADA_EMAIL, ADA_EMAIL]


def test_a_user_key_reads_its_values_an_operator_key_placeholders(
    vault_service: VaultService,
) -> None:
    service = vault_service
    with (
        service.client(service.keys.create("acme", "ada")) as ada,
        service.client(service.keys.create("acme")) as operator,
    ):
        reply = _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}, please send my receipt")
        users = _history(ada, "s-ada", reply["run_id"])
        operators = _history(operator, "s-ada", reply["run_id"])
    assert ADA_EMAIL in users and ADA_EMAIL not in operators
    assert "<EMAIL_1>" in operators


def test_an_operator_granted_values_reads_them(tmp_path: Path) -> None:
    for service in _vault_service(
        f"sqlite:///{tmp_path / 'keel.db'}", tmp_path, operators_see_values=True
    ):
        with (
            service.client(service.keys.create("acme", "ada")) as ada,
            service.client(service.keys.create("acme")) as operator,
            service.client(service.keys.create("globex")) as other_tenant,
        ):
            reply = _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}")
            assert ADA_EMAIL in _history(operator, "s-ada", reply["run_id"])
            # Granting operators values grants nothing across tenants.
            assert other_tenant.get("/v1/sessions/s-ada").status_code == 404
            assert other_tenant.get(f"/v1/runs/{reply['run_id']}").status_code == 404


def test_forget_over_http_erases_one_user_of_the_operators_tenant(
    vault_service: VaultService,
) -> None:
    service = vault_service
    with (
        service.client(service.keys.create("acme", "ada")) as ada,
        service.client(service.keys.create("acme", "bob")) as bob,
        service.client(service.keys.create("acme")) as operator,
        service.client(service.keys.create("globex")) as globex,
    ):
        _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}")
        _turn(bob, "s-bob", "bob", f"My email is {BOB_EMAIL}")
        # A user key, and another tenant's operator, cannot reach acme's users.
        assert ada.post("/v1/privacy/forget", json={"user_id": "ada"}).status_code == 404
        other = globex.post("/v1/privacy/forget", json={"user_id": "ada"})
        assert other.status_code == 200 and other.json() == {"user_id": "ada", "erased": 0}
        _turn(ada, "s-ada", "ada", "Please send my receipt")
        assert service.sent == [ADA_EMAIL]

        forgot = operator.post("/v1/privacy/forget", json={"user_id": "ada"})
        assert forgot.status_code == 200 and forgot.json() == {"user_id": "ada", "erased": 1}
        after = _turn(ada, "s-ada", "ada", "Please send my receipt again")
        assert service.sent == [ADA_EMAIL], "a tool got a forgotten value"
        assert ADA_EMAIL not in json.dumps(after)
        assert ADA_EMAIL not in ada.get("/v1/sessions/s-ada").text
        # Bob, of the same tenant, is untouched.
        _turn(bob, "s-bob", "bob", "Please send my receipt")
        assert service.sent == [ADA_EMAIL, BOB_EMAIL]
        assert BOB_EMAIL in bob.get("/v1/sessions/s-bob").text


def test_a_memory_note_sent_over_http_takes_the_users_own_placeholders(tmp_path: Path) -> None:
    for service in _vault_service(f"sqlite:///{tmp_path / 'keel.db'}", tmp_path, memory=True):
        with (
            service.client(service.keys.create("acme", "ada")) as ada,
            service.client(service.keys.create("acme")) as operator,
        ):
            _turn(ada, "s-ada", "ada", f"My email is {ADA_EMAIL}")
            note = {"user": "ada", "text": f"Ada's work email is {BOB_EMAIL}"}
            added = ada.post("/v1/memory", json=note)
            assert added.status_code == 201 and added.json()["text"] == note["text"]
            record = f"/v1/memory/{added.json()['id']}"
            # Numbered with the user's vault: her second address, not a second <EMAIL_1>.
            assert operator.get(record, params={"user": "ada"}).json()["text"] == (
                "Ada's work email is <EMAIL_2>"
            )
            assert ada.get(record, params={"user": "ada"}).json()["text"] == note["text"]


def test_forget_without_a_vault_is_404_and_a_user_key_never_reaches_it(service: Service) -> None:
    operator = service.client(service.keys.create("acme"))
    user = service.client(service.keys.create("acme", "u1"))
    with operator, user:
        answered = operator.post("/v1/privacy/forget", json={"user_id": "u1"})
        assert answered.status_code == 404
        assert "no PII vault" in answered.json()["error"]["message"]
        assert user.post("/v1/privacy/forget", json={"user_id": "u1"}).status_code == 404
        assert operator.post("/v1/privacy/forget", json={"user": "u1"}).status_code == 422
        schema = operator.get("/openapi.json").json()
        assert "post" in schema["paths"]["/v1/privacy/forget"]
