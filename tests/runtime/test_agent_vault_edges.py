"""The PII vault in the turn, the edges: its reads never block the event loop, a structured
answer shows the user's values, and a wrong or missing master key stops the agent at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from keel.errors import VaultKeyError
from keel.privacy import MasterKey, Vault
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from keel.tools import tool
from tests.privacy._spy import SpyVaultStore

EMAIL = "alice.smith@example.com"


@pytest.fixture
def spied_vault(tmp_path: Path) -> Iterator[tuple[Vault, SpyVaultStore]]:
    with SQLiteDatabase(tmp_path / "vault.db") as db:
        store = SpyVaultStore(db)
        vault = Vault(store, MasterKey.generate())
        vault.check()
        yield vault, store


def _agent(tmp_path: Path, model: ScriptedModel, vault: Vault, **options: object) -> Agent:
    return Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=model,
        system_prompt="You help customers.",
        memory=False,
        vault=vault,
        **options,  # type: ignore[arg-type]
    )


async def test_the_turns_vault_reads_run_off_the_event_loop(
    tmp_path: Path, spied_vault: tuple[Vault, SpyVaultStore]
) -> None:
    vault, store = spied_vault
    received: list[str] = []

    @tool
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to send it.
        """
        received.append(email)
        return "sent"

    model = ScriptedModel(
        [
            "Noted.",
            ScriptedModel.tool_call("send_receipt", json.dumps({"email": "<EMAIL_1>"})),
            "Sent to <EMAIL_1>.",
        ]
    )
    agent = _agent(tmp_path, model, vault, tools=[send_receipt], model_sees="values")
    try:
        await agent.run(f"I am {EMAIL}", session="s1", user="alice", turn_id="t0")
        # A later turn's values are the store's (the view that placed them is gone).
        reply = await agent.run("send my receipt", session="s1", user="alice", turn_id="t1")
        again = await agent.run("send my receipt", session="s1", user="alice", turn_id="t1")
    finally:
        await agent.aclose()
    assert received == [EMAIL]
    assert reply.text == again.text == f"Sent to {EMAIL}."
    # The tool's resolution, the prompts shown with values, the reply and its replay: every
    # read of a sealed value ran on keel's blocking pool, none on the loop.
    assert len(store.reads_on_loop) >= 4
    assert not any(store.reads_on_loop), store.reads_on_loop


async def test_a_turn_reads_back_the_values_it_placed_without_the_store(
    tmp_path: Path, spied_vault: tuple[Vault, SpyVaultStore]
) -> None:
    """The turn holds the values it masked in its own texts: its tool call and its reply
    resolve them from its view, not from a read of the sealed values."""
    vault, store = spied_vault
    received: list[str] = []

    @tool
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to send it.
        """
        received.append(email)
        return "sent"

    model = ScriptedModel(
        [
            ScriptedModel.tool_call("send_receipt", json.dumps({"email": "<EMAIL_1>"})),
            "Sent to <EMAIL_1>.",
        ]
    )
    agent = _agent(tmp_path, model, vault, tools=[send_receipt])
    try:
        reply = await agent.run(f"I am {EMAIL}", session="s1", user="alice")
    finally:
        await agent.aclose()
    assert received == [EMAIL] and reply.text == f"Sent to {EMAIL}."
    assert store.sealed_reads == 0


class Contact(BaseModel):
    name: str
    email: str
    notes: list[str]


async def test_a_structured_answer_shows_the_users_values_and_stores_placeholders(
    tmp_path: Path, spied_vault: tuple[Vault, SpyVaultStore]
) -> None:
    vault, _ = spied_vault
    answer = {"name": "Alice", "email": "<EMAIL_1>", "notes": ["write to <EMAIL_1>", "<PHONE_9>"]}
    model = ScriptedModel([json.dumps(answer)])
    agent = _agent(tmp_path, model, vault, output_type=Contact)
    try:
        reply = await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
        state = agent.session_state("s1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    # The caller gets the user's value; a placeholder the user has none for stays as written.
    assert reply.output == Contact(
        name="Alice", email=EMAIL, notes=[f"write to {EMAIL}", "<PHONE_9>"]
    )
    assert state is not None and '"email":"<EMAIL_1>"' in state.messages[-1].content.replace(
        " ", ""
    )


def _open_with_env(tmp_path: Path, how: str) -> Agent:
    model = ScriptedModel(["Hello."])
    if how == "embedded":
        return Agent.embedded(
            model,
            system_prompt="You help customers.",
            memory=False,
            settings=load_settings(data_dir=tmp_path),
        )
    return Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=model,
        system_prompt="You help customers.",
        memory=False,
    )


@pytest.mark.parametrize("how", ["open", "embedded"])
async def test_a_wrong_master_key_stops_the_agent_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    first = _open_with_env(tmp_path, how)
    await first.run(f"My email is {EMAIL}", session="s1", user="alice")
    await first.aclose()
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    with pytest.raises(VaultKeyError, match="not this vault's"):
        _open_with_env(tmp_path, how)


@pytest.mark.parametrize("how", ["open", "embedded"])
def test_a_missing_key_file_stops_the_agent_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.delenv("KEEL_PII_KEY", raising=False)
    monkeypatch.setenv("KEEL_PII_KEY_FILE", str(tmp_path / "no-such.key"))
    with pytest.raises(VaultKeyError, match=r"no-such\.key"):
        _open_with_env(tmp_path, how)


_FORGET = """
import sys
from keel.settings import load_settings
from keel.stores import Backends

with Backends.open(load_settings(database=sys.argv[1]), memory=False) as stores:
    assert stores.vault is not None
    print(stores.vault.forget("default", "alice"))
"""


async def test_a_forget_in_another_process_leaves_this_process_nothing_to_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cache this process has (the masker's, the session's log, the turn's vault view)
    was warm with alice's address when another process forgot her: the next turn here can
    neither call the tool with it nor show it."""
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    received: list[str] = []

    @tool
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to send it.
        """
        received.append(email)
        return "sent"

    send = ScriptedModel.tool_call("send_receipt", json.dumps({"email": "<EMAIL_1>"}))
    model = ScriptedModel(["Noted.", send, "Sent to <EMAIL_1>.", send, "Sent to <EMAIL_1>."])
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    agent = Agent.open(
        database, model=model, system_prompt="You help.", tools=[send_receipt], memory=False
    )
    try:
        await agent.run(f"My email is {EMAIL}", session="s1", user="alice")
        before = await agent.run("send my receipt", session="s1", user="alice")
        assert received == [EMAIL] and before.text == f"Sent to {EMAIL}."
        forgot = subprocess.run(
            [sys.executable, "-c", _FORGET, database],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert forgot.returncode == 0, forgot.stderr
        assert forgot.stdout.split() == ["1"]
        after = await agent.run("send it again", session="s1", user="alice")
    finally:
        await agent.aclose()
    assert received == [EMAIL], "a value forgotten by another process reached a tool"
    assert after.text == "Sent to <EMAIL_1>."
