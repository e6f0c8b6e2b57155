"""``keel approvals list / approve / reject``: the operator's side of the queue, as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keel.approvals import ApprovalRequest
from keel.privacy import PLACEHOLDER, MasterKey
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedCall, ScriptedModel
from keel.testing.approvals_conformance import request
from keel.tools import tool

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _keel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", "approvals", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )


def _on_queue(work: Any, database: str | None = None) -> Any:
    async def run() -> Any:
        settings = load_settings(**({} if database is None else {"database": database}))
        backends = Backends.open(settings, memory=False)
        try:
            return await work(backends.approvals)
        finally:
            await backends.aclose()

    return asyncio.run(run())


def _add(*requests: ApprovalRequest) -> None:
    async def add(store: Any) -> None:
        for made in requests:
            await store.aadd(made)

    _on_queue(add)


def _get(tenant: str, request_id: str, database: str | None = None) -> ApprovalRequest:
    found: ApprovalRequest | None = _on_queue(
        lambda store: store.aget(tenant, request_id), database
    )
    assert found is not None
    return found


def _listed(*args: str) -> list[dict[str, Any]]:
    done = _keel("list", "--json", *args)
    assert done.returncode == 0, done.stderr
    approvals: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])["approvals"]
    return approvals


@pytest.fixture(autouse=True)
def _queue() -> None:
    _add(
        request("ap-1", tenant_id="default", created_at=1.0),
        request("ap-2", tenant_id="default", created_at=2.0, user_id="bob", session_id="s2"),
        request("ap-3", tenant_id="default", created_at=3.0, kind="user", tool="cancel"),
        request("ap-9", tenant_id="acme", created_at=4.0),
    )


def test_list_shows_the_tenants_pending_queue_with_its_filters() -> None:
    assert [r["id"] for r in _listed()] == ["ap-1", "ap-2", "ap-3"]
    assert [r["id"] for r in _listed("--user", "bob")] == ["ap-2"]
    assert [r["id"] for r in _listed("--session", "s1")] == ["ap-1", "ap-3"]
    assert [r["id"] for r in _listed("--tenant", "acme")] == ["ap-9"]
    first = _listed()[0]
    assert (first["tool"], first["arguments"]) == ("refund", '{"order": "#W1", "amount": 900}')
    text = _keel("list").stdout
    assert "ap-1" in text and "refunds over 500 need an operator" in text
    assert "no approvals pending" in _keel("list", "--tenant", "nobody").stdout


def test_approve_records_the_operator_the_note_and_corrected_arguments() -> None:
    corrected = '{"order": "#W1", "amount": 500}'
    done = _keel("approve", "ap-1", "--by", "olga", "--note", "checked", "--arguments", corrected)
    assert done.returncode == 0, done.stderr
    assert "ap-1: approved by operator:olga" in done.stdout
    decided = _get("default", "ap-1")
    assert decided.status == "approved" and decided.decision is not None
    assert (decided.decision.by, decided.decision.note) == ("operator:olga", "checked")
    assert json.loads(decided.decision.arguments or "") == {"order": "#W1", "amount": 500}
    assert decided.decision.channel == "cli"
    assert [r["id"] for r in _listed()] == ["ap-2", "ap-3"]


def test_corrected_arguments_the_tools_schema_refuses_are_not_recorded() -> None:
    for bad, says in (
        ('{"order": "#W1", "amount": "lots"}', "amount: 'lots' is not of type 'integer'"),
        ('{"order": "#W1"}', "'amount' is a required property"),
        ('{"order": "#W1", "amount": 5, "to": "me"}', "Additional properties"),
    ):
        done = _keel("approve", "ap-1", "--by", "olga", "--arguments", bad)
        assert done.returncode == 1, (bad, done.stdout)
        assert "invalid arguments for 'refund'" in done.stderr and says in done.stderr
        assert _get("default", "ap-1").status == "pending"
    assert _keel("approve", "ap-1", "--by", "olga").returncode == 0  # without: approved


def test_corrections_of_a_request_made_without_a_schema_are_refused() -> None:
    _add(request("old-1", tenant_id="default", created_at=6.0, arguments_schema=None))
    done = _keel("approve", "old-1", "--arguments", '{"order": "#W1", "amount": 1}')
    assert done.returncode == 2 and "cannot be checked here: nothing was decided" in done.stderr
    assert _get("default", "old-1").status == "pending"
    assert _keel("reject", "old-1", "--note", "no").returncode == 0
    assert _get("default", "old-1").status == "rejected"


def test_a_decision_on_a_cancelled_request_exits_with_the_outcome_that_stands() -> None:
    async def cancel(store: Any) -> None:
        await store.acancel("default", "s2", "the session was reverted (to version 3)")

    _on_queue(cancel)
    done = _keel("approve", "ap-2", "--by", "olga")
    assert done.returncode == 1
    assert "ap-2 is already cancelled (the session was reverted (to version 3))" in done.stderr
    assert _get("default", "ap-2").decision is None


def _newest_email(call: ScriptedCall) -> str:
    """The newest email placeholder the model was shown."""
    seen = "\n".join(m.content for m in call.messages if m.role == "user")
    return [m.group(0) for m in PLACEHOLDER.finditer(seen) if m.group(1) == "EMAIL"][-1]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def vault_database(request: pytest.FixtureRequest) -> str:
    """The database an application with a PII vault runs on: the default SQLite file, or a
    fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{load_settings().data_dir / 'keel.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


def _stored_row(database: str, request_id: str) -> str:
    """The request's row in keel_approvals, read from the database itself (and for SQLite,
    every byte of its file and WAL), as text."""
    if database.startswith("sqlite:///"):
        path = Path(database.removeprefix("sqlite:///"))
        with contextlib.closing(sqlite3.connect(path)) as db:
            row = db.execute("SELECT * FROM keel_approvals WHERE id = ?", (request_id,)).fetchone()
        files = b"".join(part.read_bytes() for part in path.parent.glob(path.name + "*"))
        return repr(row) + files.decode("latin-1")
    import psycopg

    with psycopg.connect(database) as conn:
        found = conn.execute("SELECT * FROM keel_approvals WHERE id = %s", (request_id,))
        return repr(found.fetchone())


def test_a_cli_decision_is_stored_masked_through_the_users_vault_and_runs_with_the_value(
    monkeypatch: pytest.MonkeyPatch, vault_database: str
) -> None:
    if not vault_database.startswith("sqlite:"):
        # The embedded default keeps its own key (made when the queue was filled); a service
        # on PostgreSQL is given one.
        monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    sent: list[str] = []

    @tool(approval="operator")
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to.
        """
        sent.append(email)
        return "sent"

    def model(call: ScriptedCall) -> Any:
        if call.messages[-1].role != "user":
            return "done"
        if "receipt" in call.last_user_text:
            arguments = {"email": _newest_email(call)}
            return ScriptedModel.tool_call("send_receipt", json.dumps(arguments))
        return "noted"

    phone, new_email = "+1 415 555 2671", "new@corp.example"
    with Agent.open(
        vault_database,
        system_prompt="You send receipts.",
        model=ScriptedModel(model),
        tools=[send_receipt],
        memory=False,
    ) as agent:
        agent.run_sync("my email is ada@corp.example", session="s-r", user="ada")
        parked = agent.run_sync("send my receipt", session="s-r", user="ada")
        (waiting,) = parked.approvals
        decide = (
            "approve",
            waiting.id,
            "--by",
            "olga",
            "--note",
            f"call me at {phone}",
            "--arguments",
            json.dumps({"email": new_email}),
            "--database",
            vault_database,
        )
        done = _keel(*decide)
        assert done.returncode == 0, done.stderr
        stored = _stored_row(vault_database, waiting.id)
        assert waiting.id in stored
        raw = [value for value in (new_email, "415 555 2671") if value in stored]
        assert raw == [], "stored raw in keel_approvals"
        decision = _get("default", waiting.id, vault_database).decision
        assert decision is not None and decision.channel == "cli"
        assert decision.note is not None and "<PHONE_" in decision.note
        # Its own placeholder, not the one of the user's first address.
        assert json.loads(decision.arguments or "")["email"] not in waiting.arguments
        # The same command again is a repeat (masked alike), no error.
        again = _keel(*decide)
        assert again.returncode == 0 and "already approved" in again.stdout, again.stderr
        resumed = agent.resume_sync("s-r", "ada")
        assert resumed is not None and resumed.status == "completed"
    assert sent == [new_email]


def test_reject_needs_a_note_and_records_it() -> None:
    missing = _keel("reject", "ap-2")
    assert missing.returncode == 2 and "--note" in missing.stderr
    done = _keel("reject", "ap-2", "--note", "not for this customer", "--by", "olga")
    assert done.returncode == 0, done.stderr
    decided = _get("default", "ap-2")
    assert decided.status == "rejected" and decided.decision is not None
    assert (decided.decision.approve, decided.decision.note) == (False, "not for this customer")


def test_a_repeated_decision_is_no_error_and_a_contrary_one_is_refused() -> None:
    assert _keel("approve", "ap-1", "--by", "olga").returncode == 0
    again = _keel("approve", "ap-1", "--by", "olga")
    assert again.returncode == 0 and "already approved by operator:olga" in again.stdout
    contrary = _keel("reject", "ap-1", "--note", "no", "--by", "ivan")
    assert contrary.returncode == 1
    assert "already approved by operator:olga" in contrary.stderr
    decided = _get("default", "ap-1")
    assert decided.decision is not None and decided.decision.by == "operator:olga"


def test_another_tenants_request_is_not_found_and_left_alone() -> None:
    done = _keel("approve", "ap-9", "--by", "olga")
    assert done.returncode == 2 and "no approval request 'ap-9' in tenant 'default'" in done.stderr
    assert _get("acme", "ap-9").status == "pending"


def test_bad_corrected_arguments_are_usage_errors() -> None:
    for bad, says in (("{not json", "not JSON"), ("[1, 2]", "JSON object")):
        done = _keel("approve", "ap-1", "--arguments", bad)
        assert done.returncode == 2 and says in done.stderr
    assert _get("default", "ap-1").status == "pending"


def test_an_operator_approves_from_the_cli_and_the_agent_runs_the_call_once() -> None:
    refunds: list[str] = []

    @tool(approval="operator")
    def refund(order: str) -> str:
        """Refund an order.

        Args:
            order: The order.
        """
        refunds.append(order)
        return f"refunded {order}"

    def model(call: ScriptedCall) -> Any:
        if call.messages[-1].role == "user":
            return ScriptedModel.tool_call("refund", '{"order": "W9"}')
        return "done"

    with Agent.open(
        system_prompt="You refund.", model=ScriptedModel(model), tools=[refund], memory=False
    ) as agent:
        parked = agent.run_sync("refund W9", session="s9", user="ada")
        assert parked.status == "awaiting_approval"
        (waiting,) = parked.approvals
        assert waiting.id in [r["id"] for r in _listed("--session", "s9")]
        done = _keel("approve", waiting.id, "--by", "olga")
        assert done.returncode == 0, done.stderr
        assert refunds == []  # the command line decides; the agent's process runs the call
        resumed = agent.resume_sync("s9", "ada")
        assert resumed is not None and resumed.status == "completed"
        assert refunds == ["W9"]
        again = _keel("approve", waiting.id, "--by", "olga")
        assert again.returncode == 0 and "already approved" in again.stdout
        assert agent.resume_sync("s9", "ada") is None
        assert refunds == ["W9"]


def test_an_escalations_answer_is_recorded_with_its_action() -> None:
    _add(request("esc-1", tenant_id="default", kind="escalation", tool=None, created_at=5.0))
    wrong = _keel("approve", "esc-1", "--action", "undo")
    assert wrong.returncode == 2 and "retry, skip or answer" in wrong.stderr
    done = _keel("approve", "esc-1", "--action", "answer", "--note", "it went through")
    assert done.returncode == 0, done.stderr
    decided = _get("default", "esc-1")
    assert decided.decision is not None
    assert (decided.decision.action, decided.decision.note) == ("answer", "it went through")


@pytest.mark.postgres
def test_the_commands_work_the_queue_on_postgresql(postgres_url: str) -> None:
    async def add() -> None:
        backends = Backends.open(load_settings(database=postgres_url), memory=False)
        try:
            await backends.approvals.aadd(request("pg-1", tenant_id="acme"))
        finally:
            await backends.aclose()

    asyncio.run(add())
    listed = _listed("--database", postgres_url, "--tenant", "acme")
    assert [item["id"] for item in listed] == ["pg-1"]
    done = _keel("reject", "pg-1", "--note", "no", "--database", postgres_url, "--tenant", "acme")
    assert done.returncode == 0, done.stderr
    assert _listed("--database", postgres_url, "--tenant", "acme") == []
