"""The PII vault in the turn, through ``Agent.open`` on one SQLite file with ``KEEL_PII_KEY``:
tools get the user's real values (resolved at their boundary, for that user only), the user's
reply shows them, and everything persisted (state, journal, traces) keeps stable placeholders.
"""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

from keel.errors import UsageError
from keel.guards import GuardConfig
from keel.messages import Message
from keel.privacy import Detector, MasterKey, PIIMasker
from keel.runtime import Agent, TextDelta, TurnFinished
from keel.state import MachineState, StateMachine, Transition
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, tool

EMAIL = "alice.smith@example.com"
OLD_EMAIL = "old.address@example.org"
PHONE = "+1 415 555 0198"
API_KEY = "sk-proj-abcdefghijklmnopqrstuvwxyz012345"
RAW = (EMAIL, OLD_EMAIL, PHONE, API_KEY)

_ROOT = Path(__file__).resolve().parents[2]

Address = Annotated[str, Field(pattern=r"^[a-z.]+@[a-z.]+\.[a-z]+$")]
"""An e-mail address as a tool validates it: a placeholder is not one."""


@pytest.fixture
def pii_key(monkeypatch: pytest.MonkeyPatch) -> str:
    key = MasterKey.new_key_text()
    monkeypatch.setenv("KEEL_PII_KEY", key)
    return key


@pytest.fixture
async def opened(tmp_path: Path, pii_key: str) -> AsyncIterator[Callable[..., Agent]]:
    """Opens agents on the test's SQLite file (its vault from ``KEEL_PII_KEY``)."""
    agents: list[Agent] = []

    def open_agent(model: ScriptedModel, tools: Sequence[Tool], **options: Any) -> Agent:
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            model=model,
            system_prompt="You help customers.",
            tools=tools,
            memory=False,
            **options,
        )
        agents.append(agent)
        return agent

    yield open_agent
    for agent in agents:
        await agent.aclose()


def _sent(call: ScriptedCall) -> str:
    """Everything the model was shown in one call."""
    return "\n".join(
        message.content + "".join(c.arguments for c in message.tool_calls)
        for message in call.messages
    )


def _placeholder(call: ScriptedCall, entity: str, index: int = 0) -> str:
    found = list(dict.fromkeys(re.findall(rf"<{entity}_\d+>", _sent(call))))
    return found[index]


def _calling(name: str, **arguments: Callable[[ScriptedCall], str] | str) -> Any:
    """A scripted reply that calls ``name``; an argument may be a function of the call."""

    def reply(call: ScriptedCall) -> Message:
        values = {
            key: value(call) if callable(value) else value for key, value in arguments.items()
        }
        return ScriptedModel.tool_call(name, json.dumps(values))

    return reply


def _receipt_tool(received: list[str], *, side_effect: bool = False) -> Tool:
    @tool(side_effect=side_effect)
    def send_receipt(email: Address) -> str:
        """Send the receipt of the last order.

        Args:
            email: Where to send it.
        """
        received.append(email)
        return f"receipt sent to {email}"

    return send_receipt


def _rows(path: Path, *, but: tuple[str, ...] = ("keel_pii_values", "keel_pii_keys")) -> str:
    """Every row of every table of the database (the vault's own tables left out), as text."""
    with sqlite3.connect(path) as conn:
        tables = [
            row[0]
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if row[0] not in but
        ]
        return "\n".join(
            f"{table}: {row!r}"
            for table in tables
            for row in conn.execute(f"SELECT * FROM {table}")
        )


def _table(path: Path, table: str) -> str:
    with sqlite3.connect(path) as conn:
        return "\n".join(repr(row) for row in conn.execute(f"SELECT * FROM {table}"))


def _persisted_without_values(path: Path) -> str:
    rows = _rows(path)
    for value in RAW:
        assert value not in rows, f"{value} is stored raw"
    return rows


# --- tools get the values ----------------------------------------------------------------------


async def test_a_tool_gets_the_real_address_three_turns_after_the_user_gave_it(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    model = ScriptedModel(
        [
            "Noted.",
            "Hello.",
            "Fine, thanks.",
            _calling("send_receipt", email=lambda call: _placeholder(call, "EMAIL")),
            "Sent.",
        ]
    )
    agent = opened(model, [_receipt_tool(received)])
    for text in (f"My email is {EMAIL}", "hello", "how are you?", "send my receipt please"):
        reply = await agent.run(text, session="s1", user="alice")
        assert reply.status == "completed", reply
    assert received == [EMAIL]
    # The model only ever saw the placeholder, the same one in every turn.
    assert all(EMAIL not in _sent(call) for call in model.calls)
    assert all("<EMAIL_1>" in _sent(call) for call in model.calls)
    state = agent.session_state("s1")
    assert state is not None
    assert state.messages[0].content == "My email is <EMAIL_1>"
    _persisted_without_values(tmp_path / "keel.db")


async def test_a_tool_gets_a_phone_number_another_tool_returned_two_steps_earlier(
    opened: Callable[..., Agent],
) -> None:
    called: list[str] = []

    @tool
    def find_customer(email: Address) -> str:
        """Look a customer up by e-mail.

        Args:
            email: The customer's address.
        """
        return json.dumps({"name": "Alice Smith", "email": email, "phone": PHONE})

    @tool
    def add_note(text: str) -> str:
        """Add a note to the case.

        Args:
            text: The note.
        """
        return "noted"

    @tool(side_effect=True)
    def call_back(phone: str) -> str:
        """Call the customer back.

        Args:
            phone: The number to call.
        """
        called.append(phone)
        return "ringing"

    model = ScriptedModel(
        [
            _calling("find_customer", email=lambda call: _placeholder(call, "EMAIL")),
            _calling("add_note", text="customer found"),
            _calling("call_back", phone=lambda call: _placeholder(call, "PHONE")),
            "I am calling you now.",
        ]
    )
    agent = opened(model, [find_customer, add_note, call_back])
    reply = await agent.run(f"I am {EMAIL}, call me back", session="s1", user="alice")
    assert reply.status == "completed", reply
    assert called == [PHONE]
    # The lookup's phone number reached the model as a placeholder, never as the number.
    assert all(PHONE not in _sent(call) for call in model.calls)
    assert "<PHONE_1>" in _sent(model.calls[2])


async def test_sees_values_false_and_masked_arguments_keep_placeholders(
    opened: Callable[..., Agent],
) -> None:
    got: dict[str, Any] = {}

    @tool(sees_values=False)
    def audit(email: str) -> str:
        """Write an audit line.

        Args:
            email: Whose request it was.
        """
        got["audit"] = email
        return "audited"

    @tool(masked_arguments=("api_key",))
    def register(email: Address, api_key: str) -> str:
        """Register the customer's key.

        Args:
            email: The customer's address.
            api_key: Their key, passed on unread.
        """
        got["register"] = (email, api_key)
        return "registered"

    model = ScriptedModel(
        [
            _calling("audit", email=lambda call: _placeholder(call, "EMAIL")),
            _calling(
                "register",
                email=lambda call: _placeholder(call, "EMAIL"),
                api_key=lambda call: _placeholder(call, "API_KEY"),
            ),
            "Done.",
        ]
    )
    agent = opened(model, [audit, register])
    reply = await agent.run(f"I am {EMAIL} and my key is {API_KEY}", session="s1", user="alice")
    assert reply.status == "completed", reply
    assert got == {"audit": "<EMAIL_1>", "register": (EMAIL, "<API_KEY_1>")}


# --- what the model sees -------------------------------------------------------------------------


@pytest.mark.parametrize("model_sees", ["placeholders", "values"])
async def test_the_model_sees_placeholders_unless_the_deployment_grants_values(
    opened: Callable[..., Agent], tmp_path: Path, model_sees: str
) -> None:
    def answer(call: ScriptedCall) -> str:
        # The model repeats the address as it was shown it.
        shown = EMAIL if EMAIL in _sent(call) else _placeholder(call, "EMAIL")
        return f"I will write to {shown}."

    model = ScriptedModel(["Noted.", answer])
    agent = opened(model, [], model_sees=model_sees)
    await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
    reply = await agent.run("what will you do?", session="s1", user="alice")
    shown = [_sent(call) for call in model.calls]
    if model_sees == "values":
        assert all(EMAIL in text and "<EMAIL_1>" not in text for text in shown)
    else:
        assert all(EMAIL not in text and "<EMAIL_1>" in text for text in shown)
    # Either way the user reads the address, and nothing stored holds it.
    assert reply.text == f"I will write to {EMAIL}."
    state = agent.session_state("s1")
    assert state is not None and state.messages[-1].content == "I will write to <EMAIL_1>."
    _persisted_without_values(tmp_path / "keel.db")


# --- the reply, the state, the journal and the trace ----------------------------------------------


def _reply_model() -> ScriptedModel:
    return ScriptedModel(
        [
            "Noted.",
            _calling("send_receipt", email=lambda call: _placeholder(call, "EMAIL", 1)),
            lambda call: f"Sent to {_placeholder(call, 'EMAIL', 1)} as asked.",
        ]
    )


async def _check_persisted(agent: Agent, path: Path, run_id: str) -> None:
    rows = _persisted_without_values(path)
    state = agent.session_state("s1")
    assert state is not None
    assert state.messages[-1].content == "Sent to <EMAIL_2> as asked."
    assert state.messages[2].content == "My email is <EMAIL_2>, send my receipt"
    journal = _table(path, "keel_tool_journal")
    assert "<EMAIL_2>" in journal and "receipt sent to <EMAIL_2>" in journal
    assert agent.backends is not None
    traces = agent.backends.traces
    run = traces.get_run(run_id)
    assert run is not None and run.output == "Sent to <EMAIL_2> as asked."
    tool_steps = [step for step in traces.get_steps(run_id) if step.kind == "tool"]
    # The trace numbers as the state does: the turn's second address is <EMAIL_2> there too.
    assert [step.tool_result for step in tool_steps] == ["receipt sent to <EMAIL_2>"]
    assert "<EMAIL_2>" in (tool_steps[0].tool_arguments or "")
    assert "<EMAIL_2>" in rows


async def test_the_reply_shows_values_while_state_journal_and_trace_keep_placeholders(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    agent = opened(_reply_model(), [_receipt_tool(received, side_effect=True)])
    await agent.run(f"My old email is {OLD_EMAIL}", session="s1", user="alice")
    reply = await agent.run(
        f"My email is {EMAIL}, send my receipt", session="s1", user="alice", turn_id="t-2"
    )
    assert received == [EMAIL]
    assert reply.text == f"Sent to {EMAIL} as asked."
    await _check_persisted(agent, tmp_path / "keel.db", reply.run_id)
    # The reply recorded for the caller's retries keeps the placeholder; the retry shows values.
    state = agent.session_state("s1")
    assert state is not None
    assert "Sent to <EMAIL_2> as asked." in json.dumps(state.runtime.replies)
    again = await agent.run(
        f"My email is {EMAIL}, send my receipt", session="s1", user="alice", turn_id="t-2"
    )
    assert again.replayed and again.text == reply.text


async def test_a_streamed_reply_shows_values_and_never_splits_a_placeholder(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    model = _reply_model()
    model.stream_chunk_chars = 3
    agent = opened(model, [_receipt_tool(received, side_effect=True)])
    await agent.run(f"My old email is {OLD_EMAIL}", session="s1", user="alice")
    deltas: list[str] = []
    reply = None
    async for event in agent.stream(
        f"My email is {EMAIL}, send my receipt", session="s1", user="alice"
    ):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        elif isinstance(event, TurnFinished):
            reply = event.reply
    assert reply is not None and reply.text == f"Sent to {EMAIL} as asked."
    assert "".join(deltas) == reply.text
    # The address came whole in one delta: no delta ends inside its placeholder.
    assert any(EMAIL in delta for delta in deltas)
    assert not any("<" in delta for delta in deltas)
    await _check_persisted(agent, tmp_path / "keel.db", reply.run_id)


# --- what cannot be resolved is not called --------------------------------------------------------


async def test_another_users_or_tenants_placeholder_is_not_resolved_and_the_call_not_made(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    model = ScriptedModel(["Noted.", *[_calling("send_receipt", email="<EMAIL_1>"), "Done."] * 3])
    agent = opened(model, [_receipt_tool(received)])
    await agent.run(f"My email is {EMAIL}", session="s-alice", user="alice")
    bob = await agent.run("send my receipt", session="s-bob", user="bob")
    assert received == []
    assert bob.tool_calls == ("send_receipt",)
    assert agent.backends is not None
    other_tenant = Agent.on_backends(
        agent.backends,
        model,
        system_prompt="You help.",
        tools=[_receipt_tool(received)],
        tenant_id="other",
    )
    await other_tenant.run("send my receipt", session="s-alice", user="alice")
    assert received == [], "another tenant's alice resolved this tenant's alice's placeholder"
    # The same call in alice's own session gets her address.
    await agent.run("send my receipt", session="s-alice", user="alice")
    assert received == [EMAIL]
    results = _tool_results(agent, "s-bob")
    # Bob's model never was shown <EMAIL_1>: the refusal names it defanged (no placeholder).
    assert len(results) == 1 and "\u2039EMAIL_1\u203a" in results[0] and "not called" in results[0]


def _tool_results(agent: Agent, session: str) -> list[str]:
    state = agent.session_state(session)
    assert state is not None
    return [message.content for message in state.messages if message.role == "tool"]


def _tool_step_errors(agent: Agent, run_id: str) -> list[tuple[str | None, str | None]]:
    assert agent.backends is not None
    steps = agent.backends.traces.get_steps(run_id)
    return [(step.error_type, step.error_message) for step in steps if step.kind == "tool"]


async def test_a_tampered_vault_row_is_a_typed_error_naming_the_placeholder(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    model = ScriptedModel(
        ["Noted.", _calling("send_receipt", email=lambda call: _placeholder(call, "EMAIL")), "?"]
    )
    agent = opened(model, [_receipt_tool(received)])
    await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
    path = tmp_path / "keel.db"
    with sqlite3.connect(path) as conn:
        (sealed,) = conn.execute("SELECT sealed FROM keel_pii_values").fetchone()
        flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
        conn.execute("UPDATE keel_pii_values SET sealed = ?", (flipped,))
    reply = await agent.run("send my receipt", session="s1", user="alice")
    assert received == []
    errors = _tool_step_errors(agent, reply.run_id)
    assert errors and errors[0][0] == "PlaceholderError"
    assert "<EMAIL_1>" in (errors[0][1] or "") and "decrypt" in (errors[0][1] or "")
    assert "<EMAIL_1>" in _tool_results(agent, "s1")[0]


async def test_after_forget_the_next_turns_tool_gets_no_value(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    received: list[str] = []
    model = ScriptedModel(
        [
            "Noted.",
            *[_calling("send_receipt", email=lambda call: _placeholder(call, "EMAIL")), "?"] * 2,
        ]
    )
    agent = opened(model, [_receipt_tool(received)])
    await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
    await agent.run("send my receipt", session="s1", user="alice")
    assert received == [EMAIL]
    assert agent.vault is not None
    assert agent.vault.forget("default", "alice") == 1
    reply = await agent.run("send my receipt again", session="s1", user="alice")
    assert received == [EMAIL], "a forgotten value reached a tool"
    errors = _tool_step_errors(agent, reply.run_id)
    assert errors and errors[0][0] == "PlaceholderError" and "erased" in (errors[0][1] or "")
    # The history keeps its placeholders; the reply cannot show the erased value.
    assert EMAIL not in reply.text
    state = agent.session_state("s1")
    assert state is not None and state.messages[0].content == "My email is <EMAIL_1>"


async def test_the_workflows_remember_keeps_the_placeholder_in_the_state(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    machine = StateMachine(
        "support",
        states=[
            MachineState("asking", "gathering details", "Ask for the address.", ()),
            MachineState("done", "done", "Say goodbye.", (), terminal=True),
        ],
        transitions=[Transition("asking", "done")],
        initial="asking",
    )
    model = ScriptedModel(
        [
            _calling("remember", slot="email", value=lambda call: _placeholder(call, "EMAIL")),
            "Noted.",
        ]
    )
    agent = opened(model, [], machine=machine)
    await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
    state = agent.session_state("s1")
    assert state is not None and state.machine is not None
    assert state.machine.slots == {"email": "<EMAIL_1>"}
    _persisted_without_values(tmp_path / "keel.db")


async def test_a_value_only_its_context_reveals_is_journalled_as_its_placeholder(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    """A detector that needs the words around a value ("account 123456") does not find it in
    the call's arguments alone: the journal still gets the placeholder the value came from."""
    account = Detector("ACCOUNT", re.compile(r"account (\d{6})"), group=1)
    closed: list[str] = []

    @tool(side_effect=True)
    def close_account(number: str) -> str:
        """Close a customer account.

        Args:
            number: The account number.
        """
        closed.append(number)
        return "closed"

    model = ScriptedModel(
        [_calling("close_account", number=lambda call: _placeholder(call, "ACCOUNT")), "Done."]
    )
    agent = opened(model, [close_account], masker=PIIMasker(extra_detectors=[account]))
    await agent.run("please close my account 123456", session="s1", user="alice")
    assert closed == ["123456"]
    journal = _table(tmp_path / "keel.db", "keel_tool_journal")
    assert "<ACCOUNT_1>" in journal and "123456" not in journal


# --- across a crash -------------------------------------------------------------------------------


def _vault_worker(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "tests.runtime.vault_worker",
        "--db",
        str(tmp_path / "keel.db"),
        "--effects",
        str(tmp_path / "effects.txt"),
        *extra,
    ]
    return subprocess.run(
        command, cwd=_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_a_turn_killed_mid_tool_and_resumed_in_a_new_process_sends_the_real_address(
    tmp_path: Path, pii_key: str
) -> None:
    texts = [f"My email is {EMAIL}", "hello", "how are you?", "send my receipt"]
    killed = _vault_worker(tmp_path, "--texts", json.dumps(texts), "--kill-at-send", "1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(killed.stdout.splitlines()) == 3, "the kill was not in the fourth turn"
    effects = tmp_path / "effects.txt"
    assert not effects.exists()
    # A new process, the same key: the open turn resolves the placeholder its journal holds.
    resumed = _vault_worker(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[0]) == {"resumed": "completed", "reply": "Sent."}
    assert effects.read_text().split() == [EMAIL]
    rows = _persisted_without_values(tmp_path / "keel.db")
    assert "<EMAIL_1>" in rows


async def test_memory_records_hold_the_users_stable_placeholders(
    tmp_path: Path, pii_key: str
) -> None:
    model = ScriptedModel(["Noted.", lambda call: f"Saved {_placeholder(call, 'EMAIL', 1)}."])
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}", model=model, system_prompt="You help customers."
    )
    try:
        await agent.run(f"My old email is {OLD_EMAIL}", session="s1", user="alice")
        await agent.run(f"My new email is {EMAIL}", session="s1", user="alice")
        assert agent.memory is not None
        await agent.memory.aflush()
    finally:
        await agent.aclose()
    texts = _table(tmp_path / "keel.db", "memory_records")
    # The second address is <EMAIL_2> in memory as in the state, never a per-text <EMAIL_1>.
    assert "My new email is <EMAIL_2>" in texts and "Saved <EMAIL_2>." in texts
    _persisted_without_values(tmp_path / "keel.db")


async def test_a_failed_turns_reply_shows_the_users_values_of_what_was_done(
    opened: Callable[..., Agent], tmp_path: Path
) -> None:
    """A turn that fails after a side effect tells the user what was done, in their values;
    the state keeps the placeholders."""
    received: list[str] = []
    send = _calling("send_receipt", email=lambda call: _placeholder(call, "EMAIL"))
    agent = opened(
        ScriptedModel([send], repeat_last=True),
        [_receipt_tool(received, side_effect=True)],
        guards=GuardConfig(max_steps=1, fallback="raise"),
    )
    reply = await agent.run(f"My email is {EMAIL}, send my receipt", session="s1", user="alice")
    assert reply.status == "failed" and received == [EMAIL]
    assert f"receipt sent to {EMAIL}" in reply.text
    state = agent.session_state("s1")
    assert state is not None
    assert any("receipt sent to <EMAIL_1>" in message.content for message in state.messages)
    _persisted_without_values(tmp_path / "keel.db")


def test_values_for_the_model_need_a_vault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The embedded default makes its own key: this agent opts out of the vault on purpose.
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    with pytest.raises(UsageError, match="needs a PII vault"):
        Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            model=ScriptedModel([]),
            system_prompt="You help customers.",
            memory=False,
            model_sees="values",
        )
