"""What a decision answers, as the deciding key may read it, over real HTTP with a PII vault:
the resumed turn's reply is the user's (their values shown to them), so an operator key reads
it with placeholders, through the API and in the viewer's notice, unless the service grants
operators values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from keel.messages import Message
from keel.privacy import PLACEHOLDER, MasterKey
from keel.service import APIKeys, build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from keel.ui import COOKIE
from tests.service.conftest import serving

EMAIL = "ada.lovelace@example.com"
PHONE = "+1 415 555 2671"


@dataclass
class Shop:
    url: str
    keys: APIKeys
    sent: list[str] = field(default_factory=list)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )


def _receipts(call: ScriptedCall) -> Message | str:
    """Asked for a receipt, sends it to the newest email it was shown; once the call was
    approved, says what the tool answered, and the phone the user gave."""
    seen = "\n".join(m.content for m in call.messages if m.role == "user")
    found = [m.group(0) for m in PLACEHOLDER.finditer(seen)]
    decided = [m.content for m in call.messages if "was approved by" in m.content]
    if call.messages[-1].role != "user" and decided:
        result = decided[-1].rsplit(": ", 1)[-1]
        phones = [p for p in found if p.startswith("<PHONE_")]
        return f"Done: {result}; we call {phones[-1] if phones else 'nobody'}"
    if "receipt" in call.last_user_text:
        emails = [p for p in found if p.startswith("<EMAIL_")]
        return ScriptedModel.tool_call("send_receipt", json.dumps({"email": emails[-1]}))
    return "Noted."


def _shop(tmp_path: Path, *, operators_see_values: bool) -> Iterator[Shop]:
    sent: list[str] = []

    @tool(approval="operator")
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to.
        """
        sent.append(email)
        return f"receipt sent to {email}"

    settings = load_settings(data_dir=tmp_path, pii_key=MasterKey.new_key_text())
    app, agents, keys = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(_receipts),
        tools=[send_receipt],
        memory=False,
        settings=settings,
        operators_see_values=operators_see_values,
    )
    assert agents.backends.vault is not None
    with serving(app) as running:
        yield Shop(running.url, keys, sent)


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[Shop]:
    yield from _shop(tmp_path, operators_see_values=False)


@pytest.fixture
def open_shop(tmp_path: Path) -> Iterator[Shop]:
    yield from _shop(tmp_path, operators_see_values=True)


def _park(shop: Shop, session: str) -> str:
    """Ada gives her email and phone, then asks for her receipt: the call waits for an
    operator; the request's id."""
    with shop.client(shop.keys.create("acme", "ada")) as ada:
        for text in (f"My email is {EMAIL}, my phone {PHONE}", "Please send my receipt"):
            reply = ada.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": "ada"})
            assert reply.status_code == 200, reply.text
    (approval,) = reply.json()["approvals"]
    return str(approval["id"])


def _values_in(text: str) -> list[str]:
    return [value for value in (EMAIL, "415 555 2671") if value in text]


def test_an_operator_reads_the_reply_of_its_decision_with_placeholders(shop: Shop) -> None:
    request_id = _park(shop, "s1")
    with shop.client(shop.keys.create("acme")) as operator:
        decided = operator.post(f"/v1/approvals/{request_id}", json={"approve": True})
        assert decided.status_code == 200, decided.text
        assert _values_in(decided.text) == []
        assert decided.json()["text"].startswith("Done: receipt sent to <EMAIL_")
        assert "we call <PHONE_" in decided.json()["text"]
        # A late contrary decision's 409 shows the standing request with placeholders too.
        late = operator.post(f"/v1/approvals/{request_id}", json={"approve": False, "note": "x"})
        assert late.status_code == 409 and _values_in(late.text) == []
    assert shop.sent == [EMAIL]  # the tool was given the value


def test_the_viewers_notice_after_deciding_shows_placeholders(shop: Shop) -> None:
    request_id = _park(shop, "s2")
    with httpx.Client(base_url=shop.url, timeout=30, follow_redirects=False) as page:
        signed = page.post("/ui/login", data={"key": shop.keys.create("acme")})
        assert signed.status_code == 303 and COOKIE in signed.cookies
        decided = page.post(f"/ui/approvals/{request_id}", data={"verdict": "approve"})
    assert decided.status_code == 200
    assert f"Approved {request_id}" in decided.text and "receipt sent to &lt;EMAIL_" in (
        decided.text
    )
    assert _values_in(decided.text) == []
    assert shop.sent == [EMAIL]


def test_the_user_and_an_operator_granted_values_read_the_values(open_shop: Shop) -> None:
    with open_shop.client(open_shop.keys.create("acme")) as operator:
        decided = operator.post(f"/v1/approvals/{_park(open_shop, 's3')}", json={"approve": True})
    assert decided.status_code == 200, decided.text
    assert _values_in(decided.json()["text"]) == [EMAIL, "415 555 2671"]
    with httpx.Client(base_url=open_shop.url, timeout=30, follow_redirects=False) as page:
        page.post("/ui/login", data={"key": open_shop.keys.create("acme")})
        noticed = page.post(f"/ui/approvals/{_park(open_shop, 's4')}", data={"verdict": "approve"})
    assert f"receipt sent to {EMAIL}" in noticed.text
