"""The one opener: ``Backends.open`` from settings or a URL, and the state backend opened alone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from keel.errors import StoreError, UsageError
from keel.memory import Scope
from keel.privacy import MaskingPolicy, PIIMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import Backends, RedisStateBackend, SQLiteDatabase, open_state_backend
from keel.testing import ScriptedModel


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


def test_a_url_without_settings_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="settings="):
        Backends.open(f"sqlite:///{tmp_path / 'k.db'}")


def test_the_settings_redis_moves_state_unless_the_caller_says_not(
    tmp_path: Path, redis_url: str
) -> None:
    settings = load_settings(data_dir=tmp_path, redis_url=redis_url)
    with Backends.open(settings, memory=False) as backends:
        assert backends.redis is not None
        assert isinstance(backends.state.backend, RedisStateBackend)
    with Backends.open(settings, memory=False, redis_url="") as backends:
        assert backends.redis is None
        assert not isinstance(backends.state.backend, RedisStateBackend)


def test_leaving_the_with_block_closes_the_database(tmp_path: Path) -> None:
    with Backends.open(load_settings(data_dir=tmp_path), memory=False) as backends:
        sql = backends.sql
        assert isinstance(sql, SQLiteDatabase)
        sql.connection()
    with pytest.raises(StoreError, match="closed"):
        sql.connection()


def _outbox_workers() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "keel-memory-outbox"}


def test_memory_without_its_worker_embeds_only_when_flushed(tmp_path: Path) -> None:
    scope = Scope(tenant_id="t", user_id="u")
    before = _outbox_workers()
    with Backends.open(load_settings(data_dir=tmp_path), background=False) as backends:
        memory = backends.memory
        assert memory is not None
        assert _outbox_workers() == before, "an outbox worker was started"
        memory.add("the dog is called Rex", scope=scope)
        assert memory.embedding_status().missing == 1
        memory.flush()
        assert memory.embedding_status().missing == 0


def test_a_state_backend_opened_alone_closes_its_database(tmp_path: Path) -> None:
    backend = open_state_backend(f"sqlite:///{tmp_path / 'state.db'}")
    database = backend.database  # type: ignore[attr-defined]
    assert isinstance(database, SQLiteDatabase)
    database.connection()
    backend.close()
    with pytest.raises(StoreError, match="closed"):
        database.connection()


def test_agents_on_the_stores_mask_with_their_privacy_policy(tmp_path: Path) -> None:
    """One policy, set once on the stores, for the agents' messages, traces and memory: here
    it masks e-mail addresses only (the default would mask the phone number too)."""
    emails_only = PIIMasker(MaskingPolicy(entities=frozenset({"EMAIL"})))
    settings = load_settings(data_dir=tmp_path)
    message = "Mail bob@example.com or call +1 415 555 0100"
    with Backends.open(settings, privacy=emails_only) as backends:
        agent = Agent.on_backends(backends, ScriptedModel(["Noted."]), system_prompt="Hi.")
        agent.run_sync(message, session="s1", user="u1")
        [run] = backends.traces.list_runs()
        assert run.input is not None
        assert "bob@example.com" not in run.input and "+1 415 555 0100" in run.input
        assert agent.memory is not None and agent.memory.masker is emails_only
