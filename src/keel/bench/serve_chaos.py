"""``keel bench serve --chaos KINDS``: the service under load while its infrastructure fails.

One phase per kind, each on a fresh database (and Redis database), with ``workers`` workers of
``keel bench serve`` (the real service on PostgreSQL + Redis, the scripted model, the
side-effecting ``book``) serving ``sessions`` sessions for ``duration_s``; the client sends
each turn with its idempotency key again after a 503 or a dropped connection, as a load
balancer would, until it lands. Faults, at seeded random times (the seed is printed):

- ``postgres``: PostgreSQL shut down (``fast`` or ``immediate``, at random) for 2-10 s, then
  started again on the same socket. The state is in PostgreSQL too in this phase (with it in
  Redis, a turn goes on while PostgreSQL is down: its side-effecting calls are not run, since
  they cannot be journalled, and the model is told so);
- ``redis``: Redis stopped (SIGTERM or SIGKILL) for 2-10 s and started again on the same
  port (an append-only file fsynced at every write, so what it acknowledged survives);
- ``network``: keel reaches PostgreSQL and Redis through the cutting proxy
  ([`keel.bench._proxy`][]); every 0.5-2 s half the live connections of one of them are
  reset, whatever is in flight (a query, a ``COMMIT``, its answer);
- ``disk``: the database's tablespace (state included, as for ``postgres``) is a 256 MB
  tmpfs, filled to the last byte for 2-10 s (skipped, with the reason, where this process
  cannot mount one: not root);
- ``mcp``: the agent also has keel's MCP fault server over streamable HTTP, and each turn
  calls its non-idempotent ``write`` instead of ``book``; the server is killed and restarted,
  hung (SIGSTOP) for 2-10 s, or down for 2-10 s. Its effects are counted from its own file.

The client sends a turn again after a 503 once its ``Retry-After`` has passed (1-1.5 times it),
after a dropped connection or a 409 within 50-250 ms.

Counted per kind from the committed state and the effects (the ``bench_effects`` rows, the MCP
server's file): turns sent, committed, answered 503 (``failed_fast``, with the slowest such
answer), lost (answered 200, absent from the state afterwards), duplicated, double effects,
calls in doubt (each resolved from the effects, as the operator would); seconds down; the time
from a store's return until every worker served a turn whose effect took place again
(``recover_s``, p50 and max); and keel's added time per turn outside the fault windows (from a
fault until that recovery).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from keel.bench._chaos_servers import (
    CuttingProxy,
    FaultMCPServer,
    SmallDisk,
    StoppablePostgres,
    StoppableRedis,
    disk_refusal,
)
from keel.bench._serve_worker import EFFECTS_TABLE
from keel.bench._stats import nearest_rank
from keel.bench.serve import (
    _MODEL_CALLS_PER_TURN,
    _api_key,
    _committed,
    _create_effects_table,
    _Driver,
    _effect_counts,
    _Fleet,
    _folder,
    _Load,
    _reconcile,
    _Turn,
)
from keel.testing.servers import PostgresTestServer, postgres_server

__all__ = ["CHAOS_KINDS", "run_chaos_bench"]

CHAOS_KINDS = ("postgres", "redis", "network", "disk", "mcp")
"""The faults ``--chaos`` takes, in the order they run."""

_DISK_MB = 256
_TABLESPACE = "keel_chaos_disk"
_EFFECT_DONE = ("Done: booked", "Done: wrote")
"""How a reply starts when its turn's call took effect (the scripted model says so)."""


@dataclass
class _Fault:
    what: str
    started: float
    returned: float = 0.0


class _Injector(Protocol):
    async def inject(self, rng: random.Random, down_s: float) -> _Fault: ...


@dataclass
class _PostgresFault:
    server: StoppablePostgres

    async def inject(self, rng: random.Random, down_s: float) -> _Fault:
        mode = rng.choice(("fast", "immediate"))
        fault = _Fault(mode, time.monotonic())
        await self.server.astop(mode)
        await asyncio.sleep(down_s)
        await self.server.astart()
        fault.returned = time.monotonic()
        return fault


@dataclass
class _RedisFault:
    server: StoppableRedis

    async def inject(self, rng: random.Random, down_s: float) -> _Fault:
        how = rng.choice((signal.SIGTERM, signal.SIGKILL))
        fault = _Fault(how.name, time.monotonic())
        await self.server.astop(how)
        await asyncio.sleep(down_s)
        await self.server.astart()
        fault.returned = time.monotonic()
        return fault


@dataclass
class _NetworkFault:
    proxies: dict[str, CuttingProxy]

    async def inject(self, rng: random.Random, down_s: float) -> _Fault:
        name = rng.choice(sorted(self.proxies))
        self.proxies[name].cut_some()
        now = time.monotonic()
        return _Fault(f"cut {name}", now, now)


@dataclass
class _DiskFault:
    disk: SmallDisk

    async def inject(self, rng: random.Random, down_s: float) -> _Fault:
        fault = _Fault("full", time.monotonic())
        await self.disk.afill()
        await asyncio.sleep(down_s)
        self.disk.empty()
        fault.returned = time.monotonic()
        return fault


@dataclass
class _MCPFault:
    server: FaultMCPServer
    order: list[str] = field(default_factory=list)

    async def inject(self, rng: random.Random, down_s: float) -> _Fault:
        if not self.order:  # each of the three, in a seeded order, again and again
            self.order = rng.sample(["kill_restart", "hang", "down"], 3)
        what = self.order.pop()
        fault = _Fault(what, time.monotonic())
        if what == "hang":
            self.server.pause()
            await asyncio.sleep(down_s)
            self.server.resume()
        else:
            await self.server.akill()
            if what == "down":
                await asyncio.sleep(down_s)
            await self.server.astart()
        fault.returned = time.monotonic()
        return fault


@dataclass
class ChaosLoad:
    """One chaos run's settings."""

    workers: int
    sessions: int
    duration_s: float
    model_latency_s: float
    lease_ttl_s: float
    think_s: float
    turn_timeout_s: float
    seed: int
    down_s: tuple[float, float] = (2.0, 10.0)
    warmup_s: float = 3.0

    def load(self) -> _Load:
        return _Load(
            self.workers,
            self.sessions,
            self.duration_s,
            0.0,
            self.model_latency_s,
            self.lease_ttl_s,
            self.think_s,
            self.turn_timeout_s,
            self.seed,
        )


class _ChaosDriver(_Driver):
    """The sessions' turns, under one kind's faults instead of worker kills."""

    def __init__(
        self,
        fleet: _Fleet,
        chaos: ChaosLoad,
        client: httpx.AsyncClient,
        progress: Callable[[str], None] | None,
        injector: _Injector,
        kind: str,
    ) -> None:
        super().__init__(fleet, chaos.load(), client, progress)
        self.chaos = chaos
        self.injector = injector
        self.kind = kind
        self.fault_rng = random.Random(f"{chaos.seed}-{kind}")
        self.faults: list[_Fault] = []
        # As a well-behaved client (or a load balancer) does: a worker whose store is down is
        # not asked again before its Retry-After.
        self.honour_retry_after = True

    async def run(self) -> int:
        injecting = asyncio.create_task(self._inject())
        await asyncio.gather(*(self._session_loop(s) for s in range(self.load.sessions)))
        self.finished = time.monotonic()
        await injecting
        return len(self.faults)

    async def _inject(self) -> None:
        rng, chaos = self.fault_rng, self.chaos
        await asyncio.sleep(chaos.warmup_s)
        network = self.kind == "network"
        while True:
            down_s = 0.0 if network else rng.uniform(*chaos.down_s)
            # Room after the last fault for the workers to recover while the load goes on; a
            # short run's outage is cut to fit (at least a second).
            room = self.stop_at - 3.0 - time.monotonic()
            if room < (0.0 if network else 1.0):
                return
            down_s = min(down_s, room)
            fault = await self.injector.inject(rng, down_s)
            self.faults.append(fault)
            if self.progress is not None:
                at = fault.started - self.started
                self.progress(
                    f"{self.kind}: {fault.what} at {at:.1f} s, back after "
                    f"{fault.returned - fault.started:.1f} s"
                )
            await asyncio.sleep(rng.uniform(0.5, 2.0) if network else rng.uniform(1.0, 3.0))


def _recoveries(driver: _ChaosDriver, workers: int) -> list[float | None]:
    """Per fault: seconds from the store's return until every worker has answered a turn
    whose call took effect (None: one never did before the run ended)."""
    recovered: list[float | None] = []
    for fault in driver.faults:
        firsts: dict[int, float] = {}
        for index, at, text in driver.answered:
            if at >= fault.returned and text.startswith(_EFFECT_DONE):
                firsts[index] = min(firsts.get(index, at), at)
        complete = len(firsts) == workers
        recovered.append(max(firsts.values()) - fault.returned if complete else None)
    return recovered


def _figures(
    chaos: ChaosLoad,
    driver: _ChaosDriver,
    held: Counter[str],
    effects: Counter[str],
    reconciled: dict[str, int],
) -> dict[str, Any]:
    turns: list[_Turn] = driver.turns
    sent = {t.tag for t in turns}
    acked = {t.tag for t in turns if t.reply_status is not None}
    recoveries = _recoveries(driver, chaos.workers)
    ends = [
        f.returned + (r if r is not None else driver.finished - f.returned)
        for f, r in zip(driver.faults, recoveries, strict=True)
    ]
    windows = [(f.started, end) for f, end in zip(driver.faults, ends, strict=True)]
    model_ms = chaos.model_latency_s * _MODEL_CALLS_PER_TURN * 1000
    calm = [
        (t.ended - t.started) * 1000 - model_ms
        for t in turns
        if t.reply_status is not None
        and t.attempts == 1
        and not any(t.started < end and t.ended > start for start, end in windows)
    ]
    known = [r for r in recoveries if r is not None]
    statuses: Counter[str] = driver.statuses
    return {
        "injections": len(driver.faults),
        "faults": dict(Counter(f.what for f in driver.faults)),
        "down_s": round(sum(f.returned - f.started for f in driver.faults), 1),
        "turns_sent": len(sent),
        "committed": sum(1 for tag in sent if held[tag] >= 1),
        "failed_fast": statuses.get("503", 0),
        "failed_fast_ms_p50": round(nearest_rank(driver.refused_s, 0.5) * 1000, 1),
        "failed_fast_ms_max": round(max(driver.refused_s, default=0.0) * 1000, 1),
        "lost_turns": sum(1 for tag in acked if held[tag] == 0),
        "duplicated_turns": sum(1 for tag in sent if held[tag] > 1),
        "double_effects": sum(1 for count in effects.values() if count > 1),
        "effects_without_turn": sum(1 for tag in effects if held[tag] == 0),
        **reconciled,
        "gave_up": sum(1 for t in turns if t.gave_up),
        "recover_s_p50": round(nearest_rank(known, 0.5), 2) if known else None,
        "recover_s_max": round(max(known), 2) if known else None,
        "not_recovered": sum(1 for r in recoveries if r is None),
        "keel_added_ms": {
            "p50": round(nearest_rank(calm, 0.5), 2),
            "p99": round(nearest_rank(calm, 0.99), 2),
            "turns": len(calm),
        },
        "status_counts": dict(sorted(statuses.items())),
        "_calm_ms": calm,
    }


@dataclass
class _Phase:
    """What one kind's phase runs on."""

    kind: str
    database: str
    """The URL the workers use (through the proxy for ``network``)."""
    direct: str
    """The same database, reached directly (the effects, the API key, the counts)."""
    redis: str
    injector: _Injector
    mcp: FaultMCPServer | None = None


async def _drive_phase(
    phase: _Phase, chaos: ChaosLoad, directory: Path, progress: Callable[[str], None] | None
) -> dict[str, Any]:
    key = _api_key(phase.direct)
    options: dict[str, Any] = {
        "database": phase.database,
        "effects": phase.direct,
        "redis_url": phase.redis,
        "model_latency_s": chaos.model_latency_s,
        "lease_ttl_s": chaos.lease_ttl_s,
    }
    if phase.mcp is not None:
        options.update(mcp_url=phase.mcp.url, mcp_timeout_s=5.0)
    fleet = _Fleet(chaos.workers, options, directory)
    for index in range(chaos.workers):
        fleet.start(index)
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=chaos.sessions + 16, max_keepalive_connections=None)
    gc.collect()
    gc.freeze()
    try:
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60) as client:
            await asyncio.gather(*(fleet.ready(i, client) for i in range(chaos.workers)))
            driver = _ChaosDriver(fleet, chaos, client, progress, phase.injector, phase.kind)
            await driver.run()
            url = fleet.url(0)
            held = await _committed(client, url, chaos.sessions, "s")
            if phase.mcp is not None:
                effects = Counter(phase.mcp.written())
                reconciled = await _reconcile(
                    client, url, chaos.sessions, phase.direct, done=effects, argument="item"
                )
            else:
                reconciled = await _reconcile(client, url, chaos.sessions, phase.direct)
                effects = _effect_counts(phase.direct)
    finally:
        gc.unfreeze()
        fleet.stop()
    return _figures(chaos, driver, held, effects, reconciled)


def _proxied(url: str, port: int) -> str:
    """``url``'s database, reached through the proxy on ``port`` (TCP to its Unix socket)."""
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(url)
    return f"postgresql://{given.get('user', 'postgres')}@127.0.0.1:{port}/{given['dbname']}"


@contextlib.contextmanager
def _disk_database(server: PostgresTestServer, disk: SmallDisk) -> Iterator[str]:
    """A database whose tables live on ``disk`` (a tablespace there; PostgreSQL's own files and
    its WAL stay where they are), with the effects table off it: the truth of what happened
    must not depend on the disk under test. Dropped afterwards."""
    import psycopg

    name = f"keel_chaos_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.uri(), autocommit=True) as conn:
        conn.execute(f"CREATE TABLESPACE {_TABLESPACE} LOCATION '{disk.path}'")
        conn.execute(f'CREATE DATABASE "{name}" TABLESPACE {_TABLESPACE}')
    try:
        url = server.uri(name)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            conn.execute(
                f"CREATE TABLE {EFFECTS_TABLE} (id bigserial PRIMARY KEY, tag text NOT NULL, "
                "pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now()) "
                "TABLESPACE pg_default"
            )
        yield url
    finally:
        disk.empty()
        with psycopg.connect(server.uri(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f"DROP TABLESPACE IF EXISTS {_TABLESPACE}")


async def _run_kind(
    kind: str,
    number: int,
    servers: tuple[PostgresTestServer, StoppablePostgres, StoppableRedis],
    chaos: ChaosLoad,
    directory: Path,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    server, postgres, redis = servers
    redis_url = f"redis://127.0.0.1:{redis.port}/{number}"
    with contextlib.ExitStack() as stack:
        if kind == "disk":
            refusal = disk_refusal()
            if refusal is not None:
                return {"skipped": refusal}
            # Out of the bench's own folder (open to root alone): PostgreSQL's user must reach it.
            base = Path(tempfile.mkdtemp(prefix="keel-chaos-disk-"))
            stack.callback(shutil.rmtree, base, ignore_errors=True)
            base.chmod(0o711)
            disk = SmallDisk(base / "disk", _DISK_MB, postgres.user)
            stack.callback(disk.close)
            url = stack.enter_context(_disk_database(server, disk))
            phase = _Phase(kind, url, url, "", _DiskFault(disk))
        else:
            url = stack.enter_context(server.throwaway_database())
            _create_effects_table(url)
            if kind == "postgres":
                phase = _Phase(kind, url, url, "", _PostgresFault(postgres))
                # The server must be up again for the database to be dropped.
                stack.callback(lambda: None if postgres.running else postgres.start())
            elif kind == "redis":
                phase = _Phase(kind, url, url, redis_url, _RedisFault(redis))
            elif kind == "network":
                log = directory / "proxy-{}.log"
                pg_proxy = CuttingProxy(
                    f"unix:{postgres.socket}", Path(str(log).format("pg")), seed=chaos.seed
                )
                stack.callback(pg_proxy.close)
                redis_proxy = CuttingProxy(
                    f"127.0.0.1:{redis.port}", Path(str(log).format("redis")), seed=chaos.seed
                )
                stack.callback(redis_proxy.close)
                proxies = {"postgresql": pg_proxy, "redis": redis_proxy}
                through = f"redis://127.0.0.1:{redis_proxy.port}/{number}"
                phase = _Phase(
                    kind, _proxied(url, pg_proxy.port), url, through, _NetworkFault(proxies)
                )
            else:
                mcp = FaultMCPServer(directory / "mcp-effects.txt", directory / "mcp.log")
                mcp.start()
                stack.callback(mcp.stop)
                phase = _Phase(kind, url, url, redis_url, _MCPFault(mcp), mcp)
        figures = {
            "stores": "postgresql+redis" if phase.redis else "postgresql",
            **await _drive_phase(phase, chaos, directory, progress),
        }
        if kind == "network":
            figures["connections_cut"] = {name: len(p.cuts()) for name, p in proxies.items()}
        return figures


async def _run_all(
    kinds: list[str], chaos: ChaosLoad, progress: Callable[[str], None] | None
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(_folder())
        server = stack.enter_context(postgres_server())
        postgres = StoppablePostgres(server)
        stack.callback(postgres.stop_for_good)
        redis = stack.enter_context(StoppableRedis(directory / "redis-data").running())
        for number, kind in enumerate(kinds):
            if progress is not None:
                progress(
                    f"chaos {kind}: {chaos.workers} workers, {chaos.sessions} sessions, "
                    f"{chaos.duration_s:g} s, seed {chaos.seed}"
                )
            phase_dir = directory / kind
            phase_dir.mkdir()
            report[kind] = await _run_kind(
                kind, number, (server, postgres, redis), chaos, phase_dir, progress
            )
    return report


def run_chaos_bench(
    kinds: list[str],
    *,
    workers: int = 4,
    sessions: int = 200,
    duration_s: float = 30.0,
    model_latency_ms: float = 300.0,
    lease_ttl_s: float = 2.0,
    think_s: float = 0.0,
    turn_timeout_s: float = 60.0,
    down_s: tuple[float, float] = (2.0, 10.0),
    seed: int = 7,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One phase of ``duration_s`` per kind of ``kinds`` (of [`CHAOS_KINDS`][]), each with
    ``workers`` workers serving ``sessions`` sessions on PostgreSQL + Redis while that kind of
    fault strikes (outages of ``down_s`` seconds, seeded by ``seed``): per kind, the figures
    under ``"chaos"``; keel's added time outside the fault windows, over every kind, under
    ``"keel_added_ms"``.

    Raises:
        ValueError: a kind that is not one of ``CHAOS_KINDS``.
    """
    unknown = [kind for kind in kinds if kind not in CHAOS_KINDS]
    if unknown:
        raise ValueError(
            f"unknown chaos kind(s) {', '.join(unknown)}: use {', '.join(CHAOS_KINDS)}"
        )
    chaos = ChaosLoad(
        workers,
        sessions,
        duration_s,
        model_latency_ms / 1000,
        lease_ttl_s,
        think_s,
        turn_timeout_s,
        seed,
        down_s,
    )
    ordered = [kind for kind in CHAOS_KINDS if kind in kinds]
    per_kind = asyncio.run(_run_all(ordered, chaos, progress))
    calm = [ms for figures in per_kind.values() for ms in figures.pop("_calm_ms", [])]
    return {
        "chaos": per_kind,
        "keel_added_ms": {
            "p50": round(nearest_rank(calm, 0.5), 2),
            "p99": round(nearest_rank(calm, 0.99), 2),
            "turns": len(calm),
        },
        "workers": workers,
        "sessions": sessions,
        "duration_s": duration_s,
        "model_latency_ms": model_latency_ms,
        "down_s": list(down_s),
        "seed": seed,
    }
