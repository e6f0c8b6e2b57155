"""No ``KEEL_PII_KEY``: the embedded default gets a vault without ceremony (a key file keel makes
once in the config directory, mode 0600, said in one log line), a PostgreSQL database gets none
unless given its key (said in the log; refused when it already holds a vault), and
``KEEL_PII_VAULT=off`` / ``vault=False`` is masking only, on purpose."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import keel.stores._open as opener
from keel.errors import VaultKeyError
from keel.messages import Message
from keel.privacy import MasterKey
from keel.privacy._keys import embedded_key
from keel.runtime import Agent
from keel.settings import default_pii_key_file, load_settings
from keel.stores import Backends
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.cli import keel_process

EMAIL = "alice.smith@example.com"


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for variable in ("KEEL_PII_KEY", "KEEL_PII_KEY_FILE", "KEEL_PII_VAULT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    monkeypatch.setattr(opener, "_warned_no_vault", False)
    yield


def _key_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if "PII" in record.getMessage()]


async def test_an_embedded_agent_with_no_key_gives_tools_the_users_real_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[str] = []

    @tool
    def send_receipt(email: str) -> str:
        """Send the receipt.

        Args:
            email: Where to send it.
        """
        received.append(email)
        return f"receipt sent to {email}"

    def policy(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return "Done."
        seen = call.last_user_text
        placeholder = seen[seen.index("<") : seen.index(">") + 1]
        return ScriptedModel.tool_call("send_receipt", json.dumps({"email": placeholder}))

    caplog.set_level(logging.INFO, logger="keel")
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(policy),
        system_prompt="You send receipts.",
        tools=[send_receipt],
        memory=False,
    )
    try:
        await agent.run(f"send my receipt to {EMAIL}", session="s1", user="alice")
    finally:
        await agent.aclose()
    assert received == [EMAIL]
    path = default_pii_key_file()
    key_text = path.read_text().strip()
    assert path.stat().st_mode & 0o777 == 0o600
    [line] = _key_lines(caplog)
    assert line.levelno == logging.INFO and str(path) in line.getMessage()
    assert key_text not in caplog.text


def test_the_embedded_key_is_made_once_and_reused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keel")
    settings = load_settings(data_dir=tmp_path / "data")
    with Backends.open(settings, memory=False) as backends:
        assert backends.vault is not None
        placeholder = backends.vault.user("acme", "alice").placeholder("EMAIL", EMAIL)
        first_id = backends.vault.keys.key_id
    with Backends.open(settings, memory=False) as backends:
        assert backends.vault is not None and backends.vault.keys.key_id == first_id
        assert backends.vault.user("acme", "alice").resolve(placeholder) == EMAIL
    assert len(_key_lines(caplog)) == 1
    # Outside the database: a copy of keel.db alone opens nothing.
    assert settings.data_dir not in default_pii_key_file().parents


def test_processes_starting_at_once_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "config" / "keel" / "pii.key"
    barrier = threading.Barrier(8)

    def start() -> str:
        barrier.wait()
        return embedded_key(path).key_id

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: start(), range(8)))
    assert len(ids) == 1
    assert [p.name for p in path.parent.iterdir()] == ["pii.key"]


def test_a_sqlite_vault_sealed_with_another_key_names_the_key_file_used(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with Backends.open(settings, memory=False, pii_key=MasterKey.generate()) as backends:
        assert backends.vault is not None
        backends.vault.user("acme", "alice").placeholder("EMAIL", EMAIL)
    with pytest.raises(VaultKeyError, match="not this vault's") as raised:
        Backends.open(settings, memory=False)
    assert str(default_pii_key_file()) in str(raised.value)


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_opting_out_is_masking_only_and_makes_no_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv("KEEL_PII_VAULT", "off")
        opened = Backends.open(load_settings(data_dir=tmp_path), memory=False)
    else:
        opened = Backends.open(load_settings(data_dir=tmp_path), memory=False, vault=False)
    with opened as backends:
        assert backends.vault is None
    assert not default_pii_key_file().exists()


@pytest.mark.postgres
def test_postgresql_without_a_key_warns_once_and_refuses_a_database_holding_a_vault(
    postgres_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(database=postgres_url)
    for _ in range(2):
        with Backends.open(settings, memory=False) as backends:
            assert backends.vault is None
    warnings = [r for r in _key_lines(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the vault is off" in warnings[0].getMessage()
    assert not default_pii_key_file().exists()
    key = MasterKey.new_key_text()
    with Backends.open(settings, memory=False, pii_key=MasterKey.from_text(key)) as backends:
        assert backends.vault is not None
        backends.vault.user("acme", "alice").placeholder("EMAIL", EMAIL)
    with pytest.raises(VaultKeyError, match=r"holds a PII vault \(1 users, 1 values sealed"):
        Backends.open(settings, memory=False)
    # keel privacy status says so, counts included, without the key.
    status = keel_process("privacy", "status", "--database", postgres_url, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == {
        "vault": "key missing",
        "reason": "no KEEL_PII_KEY",
        "users": 1,
        "values": 1,
        "erased": 0,
    }
    shown = keel_process("privacy", "status", "--database", postgres_url)
    assert "KEY MISSING" in shown.stdout and "1 users, 1 values sealed" in shown.stdout
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    with Backends.open(load_settings(database=postgres_url), memory=False) as backends:
        assert backends.vault is None
