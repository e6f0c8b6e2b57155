"""One embedder setting for every entry point: Agent.embedded, keel chat, keel memory reembed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.memory import HashingEmbedder, Memory, embedder_from_settings
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.testing import ScriptedModel


def test_agent_embedded_uses_the_configured_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    agent = Agent.embedded(ScriptedModel(lambda call: "Noted."), system_prompt="hi")
    try:
        assert agent.memory is not None
        embedder = agent.memory.embedder
        assert isinstance(embedder, HashingEmbedder) and embedder.dimension == 64
        assert embedder.name == embedder_from_settings(load_settings()).name
        agent.handle_sync("s1", "u1", "My dog is called Rex")
        agent.memory.flush()
        status = agent.memory.embedding_status()
        assert status.configured == embedder.name and not status.needs_reembed
        assert set(status.counts) == {embedder.name}
    finally:
        agent.close()


def _keel(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def test_chat_and_reembed_agree_on_the_embedder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    chat = _keel("chat", "--model", "scripted:echo", stdin="My dog is called Rex\n")
    assert chat.returncode == 0, chat.stderr
    status = json.loads(_keel("memory", "status", "--json").stdout.splitlines()[-1])
    assert status["configured"] == "keel-hashing-64"
    # The turn's two records (the user's words, the model's), embedded before chat exited.
    assert status["counts"] == {"keel-hashing-64": 2} and status["needs_reembed"] is False
    reembed = json.loads(_keel("memory", "reembed", "--json").stdout.splitlines()[-1])
    assert reembed["reembedded"] == 0 and reembed["after"] == {"keel-hashing-64": 2}


def test_closing_an_agent_embeds_what_its_turns_wrote_to_memory(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    agent = Agent.embedded(
        ScriptedModel(lambda call: "Noted."), system_prompt="hi", settings=settings
    )
    memory = agent.memory
    assert memory is not None
    # No background worker: whatever is embedded by the end, closing the agent embedded.
    memory.indexer._stop.set()
    memory.indexer.notify_work()
    assert memory.indexer._worker is not None
    memory.indexer._worker.result(timeout=10)
    agent.run_sync("My dog is called Rex", session="s1", user="u1")
    assert memory.pending() == 2  # the user's words and the model's, not embedded yet
    agent.close()
    # Read back with no worker of its own (one would embed what is pending at start-up).
    assert settings.sqlite_path is not None
    database = SQLiteDatabase(settings.sqlite_path)
    try:
        stored = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=64))
        assert stored.pending() == 0
        assert stored.embedding_status().counts == {"keel-hashing-64": 2}
    finally:
        database.close()
