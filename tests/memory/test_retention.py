"""Memory retention: per-tenant policies (a tenant's own, else ``"*"``) by age, by count per
user and by kind, applied by ``keel memory prune`` as a user runs it, by two workers at once
(idempotent deletes: nothing counted twice, nothing left), and by ``keel serve``'s background
task."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from keel.errors import ConfigError
from keel.memory import Memory, MemoryFilter, RetentionPolicies, Scope, prune_memory
from keel.service import build_service
from keel.service._pruning import MemoryPruner
from keel.settings import Settings, load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from tests.cli import keel_process
from tests.service.conftest import serving

POLICY = {
    "*": {"episodic": {"max_count": 2}},
    "acme": {"episodic": {"max_count": 1}, "semantic": {"max_age_days": 30}},
    "keep-all": {},
}
EPISODIC = MemoryFilter(kinds=("episodic",))
SEMANTIC = MemoryFilter(kinds=("semantic",))


def _fill(memory: Memory) -> None:
    """Per tenant and user: four turns (episodic) and two facts (semantic)."""
    for tenant in ("acme", "globex", "keep-all"):
        for user in ("ada", "bob"):
            scope = Scope(tenant_id=tenant, user_id=user)
            for n in range(4):
                memory.add(f"turn {n} of {user}", scope=scope, kind="episodic")
            for n in range(2):
                memory.add(f"fact {n} of {user}", scope=scope, kind="semantic")


def _counts(memory: Memory) -> dict[str, int]:
    return {
        f"{tenant}/{user}": memory.store.count(Scope(tenant_id=tenant, user_id=user))
        for tenant in ("acme", "globex", "keep-all")
        for user in ("ada", "bob")
    }


def _settings(tmp_path: Path, **values: object) -> Settings:
    return load_settings(data_dir=tmp_path, embedder="hashing:64", **values)  # type: ignore[arg-type]


def test_keel_memory_prune_applies_each_tenants_policy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    with Backends.open(url, settings=_settings(tmp_path), background=False) as backends:
        assert backends.memory is not None
        _fill(backends.memory)
    env = {"KEEL_MEMORY_RETENTION": json.dumps(POLICY)}
    result = keel_process("memory", "prune", "--database", url, "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # acme keeps 1 turn per user (facts are new: kept); globex ("*") 2; keep-all everything.
    assert report["removed"] == {"acme": {"episodic": 6}, "globex": {"episodic": 4}}
    assert report["total"] == 10
    with Backends.open(url, settings=_settings(tmp_path), background=False) as backends:
        assert backends.memory is not None
        assert _counts(backends.memory) == {
            "acme/ada": 3,
            "acme/bob": 3,
            "globex/ada": 4,
            "globex/bob": 4,
            "keep-all/ada": 6,
            "keep-all/bob": 6,
        }
        # Forty days on, acme's facts are past their 30 days; no one else's policy says so.
        later = time.time() + 40 * 86_400
        policies = RetentionPolicies.parse(POLICY)
        aged = prune_memory(backends.memory.store, policies, now=later)
        assert aged.removed == {"acme": {"semantic": 4}}
        assert prune_memory(backends.memory.store, policies, now=later).total == 0


def test_a_policy_keel_does_not_know_is_one_error_line() -> None:
    bad = {"acme": {"episodc": {"max_count": 1}}}
    result = keel_process("memory", "prune", env={"KEEL_MEMORY_RETENTION": json.dumps(bad)})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "memory_retention for tenant 'acme'" in result.stderr and "episodc" in result.stderr
    with pytest.raises(ConfigError, match="max_count"):
        RetentionPolicies.parse({"*": {"episodic": {"max_count": -1}}})


@pytest.mark.parametrize("text", ["", "not json", "{'acme': {}}"])
def test_a_policy_that_is_not_json_is_one_error_line(text: str) -> None:
    result = keel_process("memory", "prune", env={"KEEL_MEMORY_RETENTION": text})
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2 and "KEEL_MEMORY_RETENTION is not valid JSON" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("tenant", ["", "  "])
def test_an_empty_tenant_is_one_error_line_not_a_clean_run(tmp_path: Path, tenant: str) -> None:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    with Backends.open(url, settings=_settings(tmp_path), background=False) as backends:
        assert backends.memory is not None
        _fill(backends.memory)
    env = {"KEEL_MEMORY_RETENTION": json.dumps(POLICY)}
    result = keel_process("memory", "prune", "--tenant", tenant, "--database", url, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "--tenant is empty" in result.stderr and "Traceback" not in result.stderr
    with Backends.open(url, settings=_settings(tmp_path), background=False) as backends:
        assert backends.memory is not None
        assert sum(_counts(backends.memory).values()) == 36  # nothing pruned


async def test_two_workers_pruning_at_once_delete_each_record_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = _settings(tmp_path)
    policies = RetentionPolicies.parse(POLICY)
    with (
        Backends.open(url, settings=settings, background=False) as first,
        Backends.open(url, settings=settings, background=False) as second,
    ):
        assert first.memory is not None and second.memory is not None
        _fill(first.memory)
        workers = [
            MemoryPruner(b.memory.store, policies, 3600) for b in (first, second) if b.memory
        ]
        reports = await asyncio.gather(*(worker.pass_once() for worker in workers))
        assert sum(report.total for report in reports) == 10
        assert _counts(first.memory)["acme/ada"] == 3 and _counts(first.memory)["globex/bob"] == 4


def test_keel_serve_prunes_on_its_own_schedule(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = _settings(tmp_path, memory_retention=POLICY, memory_prune_every_s=0.05)
    app, agents, _ = build_service(url, model=ScriptedModel(["hi"]), settings=settings)
    memory = agents.backends.memory
    assert memory is not None
    _fill(memory)
    with serving(app) as running:
        assert httpx.get(f"{running.url}/health").status_code == 200
        deadline = time.monotonic() + 30
        while _counts(memory)["globex/ada"] != 4:
            assert time.monotonic() < deadline, f"not pruned: {_counts(memory)}"
            time.sleep(0.05)
        # One pass prunes the tenants in order: acme's went before globex's.
        assert _counts(memory)["acme/bob"] == 3 and _counts(memory)["keep-all/ada"] == 6


@pytest.mark.postgres
def test_keel_memory_prune_on_postgresql_leaves_searches_only_what_it_kept(
    tmp_path: Path, postgres_url: str
) -> None:
    settings = _settings(tmp_path)
    with Backends.open(postgres_url, settings=settings, background=False) as backends:
        assert backends.memory is not None
        _fill(backends.memory)
    env = {"KEEL_MEMORY_RETENTION": json.dumps(POLICY)}
    result = keel_process("memory", "prune", "--database", postgres_url, "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["removed"] == {"acme": {"episodic": 6}, "globex": {"episodic": 4}}
    with Backends.open(postgres_url, settings=settings, background=False) as backends:
        memory = backends.memory
        assert memory is not None
        # Searches read the narrow rows (memory_search_rows on PostgreSQL): a pruned turn is
        # never found, each kept one still is, and only in its own scope.
        for tenant, kept in (("acme", 1), ("globex", 2), ("keep-all", 4)):
            for user in ("ada", "bob"):
                scope = Scope(tenant_id=tenant, user_id=user)
                hits = memory.search("turn of", scope=scope, k=10, filters=EPISODIC)
                texts = sorted(hit.record.text for hit in hits)
                assert texts == [f"turn {n} of {user}" for n in range(4 - kept, 4)], texts
                assert all(hit.record.tenant_id == tenant for hit in hits)
                # The ranking itself, before records are read back (which drops a gone one).
                ranked = memory.store.keyword_search(scope, ["turn"], EPISODIC, 10)
                assert {hit.record_id for hit in ranked} == {hit.record.id for hit in hits}
        # Forty days on, acme's facts go as well, from the searches too.
        later = time.time() + 40 * 86_400
        aged = prune_memory(memory.store, RetentionPolicies.parse(POLICY), now=later)
        assert aged.removed == {"acme": {"semantic": 4}}
        acme = Scope(tenant_id="acme", user_id="ada")
        assert not memory.search("fact of ada", scope=acme, k=10, filters=SEMANTIC)
        assert memory.search("fact of ada", scope=Scope(tenant_id="globex", user_id="ada"), k=10)
