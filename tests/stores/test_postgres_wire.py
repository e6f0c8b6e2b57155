"""A fresh process writes its first memory vectors on PostgreSQL through connections its pool
opened before any memory store existed (as `Agent.open` and `keel serve` do: one pool for
every store)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.postgres

_FIRST_VECTORS = textwrap.dedent(
    """
    import sys

    from keel.memory import HashingEmbedder, Memory, Scope
    from keel.stores import PostgresDatabase, PostgresMemoryStore

    database = PostgresDatabase(sys.argv[1], min_size=1, max_size=1)
    database.open()  # the pool's one connection opens before the memory store is made
    memory = Memory(PostgresMemoryStore(database), embedder=HashingEmbedder(64), masker=None)
    scope = Scope(tenant_id="acme", user_id="alice")
    memory.add("Alice is allergic to peanuts", scope=scope)
    memory.flush(timeout=30)
    hits = memory.search("peanut allergy", scope=scope, k=1)
    print(hits[0].record.text, hits[0].similarity is not None)
    database.close()
    """
)


def test_a_fresh_process_embeds_through_connections_opened_before_its_memory_store(
    postgres_url: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_VECTORS, postgres_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Alice is allergic to peanuts True", done.stdout
