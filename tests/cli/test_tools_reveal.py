"""``keel tools in-doubt --reveal``: an operator settling a call left in doubt compares it
with the other system's records, which hold the values the tool was given; the journal keeps
the arguments masked. With the PII key the command shows them with the session user's values
(each read logged); with the vault off it says why; plain, it shows them masked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel
from tests.cli import keel_process

ADDRESS = "667 Highland Drive"


def _in_doubt_call(database: str, key_text: str) -> str:
    """A session of user alice with one side-effecting call left in doubt, its address
    masked; the call's arguments as the journal keeps them."""
    agent = Agent.open(
        database,
        model=ScriptedModel(["Noted."]),
        system_prompt="s",
        memory=False,
        settings=load_settings(pii_key=key_text),
    )
    try:
        agent.run_sync("Hello", session="s1", user="alice")
        assert agent.vault is not None and agent.journal is not None
        shown = agent.vault.user(agent.tenant_id, "alice").placeholder("ADDRESS", ADDRESS)
        arguments = json.dumps({"order_id": "#W1", "address1": shown})
        agent.journal.claim(
            key="k1",
            session_id=agent.session_key("s1"),
            step=2,
            call_index=0,
            tool="modify_address",
            arguments=arguments,
        )
    finally:
        agent.close()
    return arguments


def _listed(database: str, *options: str, key_text: str = "") -> list[dict[str, object]]:
    env = {"KEEL_PII_KEY": key_text} if key_text else {}
    result = keel_process("tools", "in-doubt", "--database", database, "--json", *options, env=env)
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, object]] = json.loads(result.stdout.splitlines()[-1])["in_doubt"]
    return listed


def test_an_operator_reads_an_in_doubt_calls_values_with_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEEL_PII_KEY", raising=False)
    monkeypatch.delenv("KEEL_PII_KEY_FILE", raising=False)
    key_text = MasterKey.new_key_text()
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    masked = _in_doubt_call(database, key_text)
    assert ADDRESS not in masked
    [plain] = _listed(database, key_text=key_text)
    assert plain["arguments"] == masked
    [revealed] = _listed(database, "--reveal", key_text=key_text)
    assert json.loads(str(revealed["arguments"])) == {"order_id": "#W1", "address1": ADDRESS}
    refused = keel_process(
        "tools", "in-doubt", "--database", database, "--reveal", env={"KEEL_PII_VAULT": "off"}
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--reveal needs the PII key" in refused.stderr
