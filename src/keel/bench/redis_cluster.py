"""``keel bench redis-cluster``: state writes under load on a real Redis Cluster (three
primaries, three replicas on loopback ports) while a slot range is resharded
(``redis-cli --cluster reshard``) and a primary is SIGKILLed (its replica takes over), then
every node crashed at once and started again, counted from the state itself.

Two configurations, one cluster each: ``durable`` (what docs/deployment.md asks: an append-only
file fsynced on every write, each state write acknowledged once a replica has it, ``WAIT 1``)
and ``defaults`` (the tests' Redis: no persistence, no WAIT). Each writer adds one item named
after itself and its sequence number to a session's ``CounterState`` with compare-and-set and
records the items it was acknowledged; afterwards each session's committed items are compared
with the acknowledged ones: ``lost`` (acknowledged, not in the state), ``duplicated`` (in the
state twice), and whether every session's version is one more than its items (no commit
without its item, none twice).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from keel.errors import BackendUnavailableError, ConflictError, StoreError
from keel.settings import load_settings
from keel.state import StateStore
from keel.stores import Backends
from keel.testing._state_models import CounterState
from keel.testing.topologies import RedisTestCluster, redis_cluster, wait_until_healthy

__all__ = ["run_redis_cluster_bench"]

Progress = Callable[[str], None]


class _Load:
    """Writers adding items to sessions until told to stop; what each was acknowledged."""

    def __init__(self, store: StateStore[CounterState], sessions: list[str], writers: int) -> None:
        self.store = store
        self.sessions = sessions
        self.writers = writers
        self.acknowledged: dict[str, set[str]] = {s: set() for s in sessions}
        self.failed: Counter[str] = Counter()
        self.conflicts = 0
        self.stop = asyncio.Event()

    async def writer(self, number: int, seed: int) -> None:
        rng = random.Random(seed * 1000 + number)
        sequence = 0
        while not self.stop.is_set():
            session = rng.choice(self.sessions)
            item = f"w{number}:{sequence}"
            sequence += 1
            try:
                head = await self.store.aget(session)
                if head is None:
                    self.failed["absent"] += 1
                    await asyncio.sleep(0.01)
                    continue
                await self.store.aupdate(
                    session, {"counter": 1, "items": [item]}, expected_version=head.version
                )
            except ConflictError:
                self.conflicts += 1
                continue
            except (BackendUnavailableError, StoreError) as exc:
                # Not acknowledged: in doubt (it may have landed) or never sent.
                self.failed[type(exc).__name__] += 1
                await asyncio.sleep(0.05)
                continue
            self.acknowledged[session].add(item)

    def committed(self) -> int:
        return sum(len(items) for items in self.acknowledged.values())


async def _count(store: StateStore[CounterState], load: _Load) -> dict[str, Any]:
    """Lost and duplicated writes, counted from each session's committed state."""
    lost = duplicated = inconsistent = missing_sessions = landed_unacknowledged = 0
    for session in load.sessions:
        try:
            head = await store.aget(session)
        except StoreError:
            head = None
        if head is None:
            missing_sessions += 1
            lost += len(load.acknowledged[session])
            continue
        items = Counter(head.state.items)
        duplicated += sum(count - 1 for count in items.values() if count > 1)
        lost += len(load.acknowledged[session] - set(items))
        landed_unacknowledged += len(set(items) - load.acknowledged[session])
        if head.version != 1 + len(head.state.items) or head.state.counter != len(head.state.items):
            inconsistent += 1
    return {
        "acknowledged": load.committed(),
        "lost": lost,
        "duplicated": duplicated,
        "sessions_missing": missing_sessions,
        "sessions_inconsistent": inconsistent,
        "landed_without_ack": landed_unacknowledged,
    }


def _primary_ids(cluster: RedisTestCluster) -> dict[int, str]:
    """Port -> node id of each primary that serves slots."""
    port = next(n.port for n in cluster.nodes if n.process is not None)
    out: dict[int, str] = {}
    for line in cluster.redis_cli("-p", str(port), "cluster", "nodes").splitlines():
        fields = line.split()
        if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
            out[int(fields[1].split("@")[0].rsplit(":", 1)[1])] = fields[0]
    return out


async def _reshard(cluster: RedisTestCluster, slots: int, progress: Progress) -> float:
    primaries = _primary_ids(cluster)
    (source, from_id), (_, to_id) = list(primaries.items())[:2]
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        cluster.cli, "--cluster", "reshard", f"127.0.0.1:{source}",
        "--cluster-from", from_id, "--cluster-to", to_id,
        "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "50",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, error = await process.communicate()
    if process.returncode != 0:
        raise BackendUnavailableError(f"redis-cli --cluster reshard failed: {error.decode()}")
    progress(f"  resharded {slots} slots in {time.perf_counter() - started:.1f} s")
    return time.perf_counter() - started


async def _kill_a_primary(cluster: RedisTestCluster, progress: Progress) -> float:
    victim = next(iter(_primary_ids(cluster)))
    started = time.perf_counter()
    cluster.kill(victim)
    await asyncio.to_thread(wait_until_healthy, cluster, replicas=0)
    taken_over = time.perf_counter() - started
    progress(f"  primary {victim} SIGKILLed: its replica took over in {taken_over:.1f} s")
    cluster.start(victim)
    await asyncio.to_thread(wait_until_healthy, cluster, replicas=1)
    return taken_over


async def _crash_everything(cluster: RedisTestCluster, progress: Progress) -> None:
    for node in cluster.nodes:
        cluster.kill(node.port)
    for node in cluster.nodes:
        cluster.start(node.port)
    await asyncio.to_thread(wait_until_healthy, cluster, replicas=1, timeout_s=120)
    progress("  every node SIGKILLed and started again")


async def _one_configuration(
    durable: bool, sessions: int, writers: int, seconds: float, slots: int, seed: int,
    progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    name = "durable" if durable else "defaults"
    progress(f"{name}: starting a 3+3 Redis Cluster")
    with redis_cluster(durable=durable) as cluster:
        settings = load_settings(
            redis_wait_replicas=1 if durable else 0,
            redis_durability="require" if durable else "off",
        )
        backends = Backends.open(cluster.url, settings=settings, only=("state",))
        store = StateStore(backends.state.backend, CounterState, snapshot_every=20)
        ids = [f"s{i}" for i in range(sessions)]
        for session in ids:
            await store.acreate(session, CounterState())
        load = _Load(store, ids, writers)
        tasks = [asyncio.ensure_future(load.writer(i, seed)) for i in range(writers)]
        started = time.perf_counter()
        await asyncio.sleep(seconds / 4)
        reshard_s = await _reshard(cluster, slots, progress)
        await asyncio.sleep(seconds / 4)
        takeover_s = await _kill_a_primary(cluster, progress)
        await asyncio.sleep(seconds / 4)
        load.stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        after_faults = await _count(store, load)
        progress(f"  {after_faults}")
        await store.aclose()
        await _crash_everything(cluster, progress)
        backends = Backends.open(cluster.url, settings=settings, only=("state",))
        store = StateStore(backends.state.backend, CounterState)
        after_crash = await _count(store, load)
        progress(f"  after every node crashed: {after_crash}")
        await store.aclose()
    return {
        "wait_replicas": 1 if durable else 0,
        "appendfsync": "always" if durable else "no persistence",
        "writes_per_s": round(load.committed() / elapsed, 1),
        "failed_writes": sum(load.failed.values()),
        "failed_by_error": dict(load.failed),
        "conflicts": load.conflicts,
        "reshard_s": round(reshard_s, 2),
        "failover_s": round(takeover_s, 2),
        "after_reshard_and_failover": after_faults,
        "after_every_node_crashed": after_crash,
    }


def run_redis_cluster_bench(
    *,
    sessions: int = 200,
    writers: int = 32,
    seconds: float = 12.0,
    slots: int = 2000,
    seed: int = 48,
    configurations: tuple[str, ...] = ("durable", "defaults"),
    progress: Progress = lambda _: None,
) -> dict[str, Any]:
    """Run the bench (see the module's docstring); the report, one JSON-able dict."""

    async def run() -> dict[str, Any]:
        report: dict[str, Any] = {
            "sessions": sessions,
            "writers": writers,
            "seconds": seconds,
            "resharded_slots": slots,
            "seed": seed,
        }
        for name in configurations:
            report[name] = await _one_configuration(
                name == "durable", sessions, writers, seconds, slots, seed, progress
            )
        return report

    return asyncio.run(run())
