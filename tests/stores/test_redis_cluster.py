"""The Redis state backend on a real Redis Cluster (three primaries, three replicas), through
``redis+cluster://`` and redis-py's cluster-aware client: the state conformance suite passes
(each write waiting for its replica, as docs/deployment.md asks), a session's keys stay on one
slot, a slot moving under a writer is followed (``ASK``, then ``MOVED``), the version check
still rejects a stale writer across a failover, the start-up check refuses a Redis without an
fsynced append-only file when told to, and the rate limiter's count is shared there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keel.errors import ConfigError, ConflictError
from keel.service._limits import RateLimiter
from keel.settings import load_settings
from keel.state import StateStore
from keel.stores import Backends
from keel.testing._state_models import CounterState
from keel.testing.state_conformance import StateBackendConformance
from keel.testing.topologies import RedisTestCluster, wait_until_healthy

pytestmark = pytest.mark.redis


class TestRedisStateOnACluster(StateBackendConformance):
    """Every state write waits for one replica (``WAIT 1``): the pipelined path, on the
    connection to the primary of the session's slot."""

    @pytest.fixture(autouse=True)
    def _wait_for_a_replica(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KEEL_REDIS_WAIT_REPLICAS", "1")

    @pytest.fixture
    def state_backend_url(self, redis_cluster_url: str) -> str:
        return redis_cluster_url


def _cluster(cluster: RedisTestCluster) -> Any:
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes])


@pytest.fixture
def raw(redis_test_cluster: RedisTestCluster, redis_cluster_url: str) -> Iterator[Any]:
    client = _cluster(redis_test_cluster)
    yield client
    client.close()


def _store(tmp_path: Path, url: str, **settings: Any) -> StateStore[Any]:
    backends = Backends.open(url, settings=load_settings(**settings), only=("state",))
    return StateStore(backends.state.backend, CounterState, snapshot_every=3)


def test_a_sessions_keys_stay_on_one_slot(tmp_path: Path, redis_cluster_url: str, raw: Any) -> None:
    store = _store(tmp_path, redis_cluster_url)
    try:
        for session in ("alice", "bob", "carol"):
            store.create(session, CounterState())
            for i in range(4):
                store.update(session, {"counter": i + 1}, expected_version=i + 1)
        for session in ("alice", "bob", "carol"):
            keys = [
                k.decode() for k in raw.scan_iter(match=f"keel:state:{{{session}}}:*", count=1000)
            ]
            assert {k.rsplit(":", 1)[1] for k in keys} == {"head", "rows", "fulls"}
            slots = {raw.keyslot(k) for k in keys}
            assert len(slots) == 1
            (slot,) = slots
            node = raw.nodes_manager.get_node_from_slot(slot)
            assert all(raw.get_redis_connection(node).exists(k) for k in keys)
        # The three sessions are spread over more than one slot: the tag is per session.
        assert len({raw.keyslot(f"{{{s}}}") for s in ("alice", "bob", "carol")}) == 3
    finally:
        store.close()


def _node_id(raw: Any, node: Any) -> str:
    return str(raw.get_redis_connection(node).execute_command("CLUSTER", "MYID").decode())


def _start_moving(raw: Any, session: str) -> tuple[int, Any, Any, list[Any]]:
    """Start moving ``session``'s slot to another primary, as ``redis-cli --cluster reshard``
    does: the target IMPORTING, the source MIGRATING. Returns the slot, the source's and the
    target's clients, and the source's keys (not moved yet)."""
    slot = raw.keyslot(f"keel:state:{{{session}}}:head")
    source = raw.nodes_manager.get_node_from_slot(slot)
    target = next(n for n in raw.get_primaries() if n.name != source.name)
    src, dst = raw.get_redis_connection(source), raw.get_redis_connection(target)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(raw, source))
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(raw, target))
    keys = [k.decode() for k in src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)]
    return slot, src, dst, keys


def _move_keys(src: Any, dst: Any, keys: list[Any]) -> None:
    where = dst.connection_pool.connection_kwargs
    src.execute_command("MIGRATE", where["host"], where["port"], "", 0, 5000, "KEYS", *keys)


def _hand_over(raw: Any, slot: int, src: Any, dst: Any) -> None:
    owner = str(dst.execute_command("CLUSTER", "MYID").decode())
    for node in (src, dst):
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)


@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_writes_follow_a_slot_moving_under_them(
    tmp_path: Path, redis_cluster_url: str, raw: Any, wait_replicas: int
) -> None:
    """A session's slot is migrated by hand: with its keys on the new primary but the slot not
    yet handed over, a write is redirected with ASK; once handed over, with MOVED. Sync and
    async writes land once each. (The session has a TTL, so all four of its keys exist: a
    script on keys of which some are missing gets TRYAGAIN instead, the next test's case.)"""
    store = _store(tmp_path, redis_cluster_url, redis_wait_replicas=wait_replicas)
    try:
        store.create("moving", CounterState(), ttl=3600)
        store.update("moving", {"counter": 1}, expected_version=1)
        slot, src, dst, keys = _start_moving(raw, "moving")
        assert len(keys) == 4
        _move_keys(src, dst, keys)
        store.update("moving", {"counter": 1}, expected_version=2)
        await store.aupdate("moving", {"counter": 1}, expected_version=3)
        asks = _errorstat(src, "ASK")
        assert asks >= 2
        _hand_over(raw, slot, src, dst)
        store.update("moving", {"counter": 1}, expected_version=4)
        await store.aupdate("moving", {"counter": 1}, expected_version=5)
        assert _errorstat(src, "MOVED") >= 1
        loaded = store.load("moving")
        assert loaded.version == 6 and loaded.state.counter == 5
        assert [i.version for i in store.history("moving")] == [6, 5, 4, 3, 2, 1]
        counts = [n.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for n in (src, dst)]
        assert counts == [0, 4]
    finally:
        await store.aclose()


def _errorstat(node: Any, name: str) -> int:
    stats = node.info("errorstats")
    return int(stats.get(f"errorstat_{name}", {}).get("count", 0))


async def test_a_write_to_a_half_moved_slot_waits_for_the_move_to_end(
    tmp_path: Path, redis_cluster_url: str, raw: Any
) -> None:
    """A session without a TTL has no tombstone key: while its slot is half-moved the target
    answers TRYAGAIN (some keys missing), and the write retries until the slot is handed
    over, then lands once."""
    store = _store(tmp_path, redis_cluster_url)
    try:
        store.create("halfway", CounterState())
        slot, src, dst, keys = _start_moving(raw, "halfway")
        _move_keys(src, dst, keys)
        before = _errorstat(dst, "TRYAGAIN")
        write = asyncio.ensure_future(store.aupdate("halfway", {"counter": 7}, expected_version=1))
        while _errorstat(dst, "TRYAGAIN") == before and not write.done():
            await asyncio.sleep(0.01)
        assert not write.done()
        _hand_over(raw, slot, src, dst)
        assert (await write).version == 2
        loaded = store.load("halfway")
        assert (loaded.version, loaded.state.counter) == (2, 7)
    finally:
        await store.aclose()


def test_a_stale_writer_is_rejected_across_a_failover(
    tmp_path: Path, redis_test_cluster: RedisTestCluster, redis_cluster_url: str, raw: Any
) -> None:
    """Writer A read version 2; writer B wrote 3 (waited for by the replica); the primary
    fails over to that replica; A's write, expecting 2, is rejected, and B's write is there."""
    a = _store(tmp_path, redis_cluster_url, redis_wait_replicas=1)
    b = _store(tmp_path, redis_cluster_url, redis_wait_replicas=1)
    try:
        a.create("contended", CounterState())
        a.update("contended", {"counter": 1}, expected_version=1)
        seen = a.load("contended").version
        b.update("contended", {"counter": 10, "note": "b"}, expected_version=seen)
        slot = raw.keyslot("keel:state:{contended}:head")
        primary = raw.nodes_manager.get_node_from_slot(slot)
        info = raw.get_redis_connection(primary).info("replication")
        replica_port = int(info["slave0"]["port"])
        redis_test_cluster.redis_cli("-p", str(replica_port), "cluster", "failover")
        wait_until_healthy(redis_test_cluster, replicas=1)
        assert "role:master" in redis_test_cluster.redis_cli(
            "-p", str(replica_port), "info", "replication"
        )
        with pytest.raises(ConflictError):
            a.update("contended", {"counter": 100, "note": "stale"}, expected_version=seen)
        fresh = b.load("contended")
        assert (fresh.version, fresh.state.counter, fresh.state.note) == (3, 11, "b")
    finally:
        a.close()
        b.close()


def test_the_start_up_check_refuses_a_redis_that_can_lose_writes(
    tmp_path: Path,
    redis_cluster_url: str,
    raw: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No persistence (the test cluster's): ``require`` refuses it, naming what is missing;
    the default warns once (a process warns once per Redis: forget the warnings logged by
    the tests before); with an fsynced append-only file on every primary, ``require``
    opens."""
    monkeypatch.setattr("keel.stores._redis_state._WARNED_NOT_DURABLE", set())
    with pytest.raises(ConfigError, match="appendonly is 'no'"):
        _store(tmp_path, redis_cluster_url, redis_durability="require")
    with pytest.raises(ConfigError, match="fewer than the 2 each state write waits for"):
        _store(tmp_path, redis_cluster_url, redis_durability="require", redis_wait_replicas=2)
    with caplog.at_level(logging.WARNING, logger="keel.stores"):
        _store(tmp_path, redis_cluster_url).close()
    assert "can lose acknowledged state writes" in caplog.text
    primaries = [raw.get_redis_connection(n) for n in raw.get_primaries()]
    try:
        for node in primaries:
            node.config_set("appendonly", "yes")
            node.config_set("appendfsync", "always")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="keel.stores"):
            store = _store(
                tmp_path, redis_cluster_url, redis_durability="require", redis_wait_replicas=1
            )
        store.create("durable", CounterState())
        assert store.load("durable").version == 1
        store.close()
        assert "can lose" not in caplog.text
    finally:
        for node in primaries:
            node.config_set("appendonly", "no")


async def test_the_rate_limit_is_one_count_across_workers_on_a_cluster(
    redis_cluster_url: str,
) -> None:
    first = RateLimiter(3, redis_url=redis_cluster_url, clock=lambda: 120.0)
    second = RateLimiter(3, redis_url=redis_cluster_url, clock=lambda: 120.0)
    try:
        waits = [await limiter.check("key-1") for limiter in (first, second, first, second)]
        assert waits[:3] == [None, None, None] and waits[3] is not None
        assert await first.check("key-2") is None
    finally:
        await first.aclose()
        await second.aclose()
