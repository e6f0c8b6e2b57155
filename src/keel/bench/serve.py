"""``keel bench serve``: the service under load while its workers are SIGKILLed.

A throwaway embedded PostgreSQL and a Redis are started, then ``workers`` service processes
(``keel.bench._serve_worker``: the real ``build_service`` on 127.0.0.1 ports) on them. A
bounded client loop drives ``sessions`` concurrent sessions, round-robin across the workers;
each turn carries an idempotency key (the turn's tag) and is retried on a dropped connection,
409 or 503 until it lands. The scripted model answers after a fixed latency; each turn calls
the side-effecting tool ``book`` once, whose effect is a row in ``bench_effects``. Every
``kill_every_s`` a random worker is SIGKILLed and restarted.

Everything is counted from the effects themselves, read back at the end:
- **lost turns**: tags the client sent that are absent from the session's final state;
- **duplicated turns**: tags held twice in the final state;
- **double effects**: tags with more than one ``bench_effects`` row; **missing effects**:
  completed turns with none;
- **keel-added latency**: the client's time for a turn minus the model's two latencies, over
  the turns outside the kill windows (from a SIGKILL until the restarted worker answers) that
  landed on their first attempt, over every turn that landed on its first attempt (a turn
  whose worker died under it, or that was sent to a worker still restarting, needed another),
  and over all;
- **RSS** of each worker process, sampled every second.

Then the same on SQLite with one worker (``sqlite``).

``--hostile`` (`run_hostile_bench`) is another run: one worker on SQLite serving normal
sessions while hostile clients send it 10 MB chunked bodies and bodies a byte a second (from a
process of their own); it reports whether every normal turn committed, the worker's peak RSS
over its idle RSS (the kernel's peak count, reset once the worker is warm), ``/health``
latency, and what the hostile requests got (413, 408, a reset connection).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from keel.bench._serve_worker import EFFECTS_TABLE, WORKER_ENV
from keel.bench._stats import nearest_rank
from keel.service import APIKeys
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing.servers import free_port, postgres_server, redis_server

__all__ = ["run_hostile_bench", "run_serve_bench"]

_TENANT = "bench"
_MODEL_CALLS_PER_TURN = 2


@dataclass
class _Turn:
    tag: str
    started: float
    ended: float = 0.0
    attempts: int = 0
    reply_status: str | None = None
    gave_up: bool = False


@dataclass
class _Worker:
    index: int
    port: int
    process: subprocess.Popen[bytes]
    started: float
    rss_kb: list[tuple[float, int]] = field(default_factory=list)


def _rss_kb(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident memory in kB (``VmHWM``: its peak), from ``/proc``."""
    try:
        with Path(f"/proc/{pid}/status").open() as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _Fleet:
    """The worker processes: started, killed (SIGKILL) and restarted on their ports."""

    def __init__(self, count: int, options: dict[str, Any], directory: Path) -> None:
        self.options = options
        self.directory = directory
        self.ports = [free_port() for _ in range(count)]
        self.live: dict[int, _Worker] = {}
        self.retired: list[_Worker] = []

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    def start(self, index: int) -> None:
        env = {
            **os.environ,
            "KEEL_DATA_DIR": str(self.directory / "data"),
            WORKER_ENV: json.dumps({**self.options, "port": self.ports[index]}),
        }
        with (self.directory / f"worker-{index}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "keel.bench._serve_worker"],
                env=env,
                stdout=log,
                stderr=log,
            )
        self.live[index] = _Worker(index, self.ports[index], process, time.monotonic())

    def kill(self, index: int) -> None:
        worker = self.live.pop(index)
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        self.retired.append(worker)

    async def ready(self, index: int, client: Any, timeout_s: float = 180.0) -> None:
        # A worker with memory loads its embedder before /ready (MiniLM: a second or two on
        # a quiet machine, tens of seconds on a loaded 2-core one).
        deadline = time.monotonic() + timeout_s
        while True:
            worker = self.live[index]
            if worker.process.poll() is not None:
                log = (self.directory / f"worker-{index}.log").read_text(errors="replace")
                raise RuntimeError(f"worker {index} exited at start:\n{log[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{self.url(index)}/ready", timeout=2)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {index} did not answer within {timeout_s} s")
            await asyncio.sleep(0.1)

    def sample_rss(self) -> None:
        now = time.monotonic()
        for worker in self.live.values():
            rss = _rss_kb(worker.process.pid)
            if rss is not None:
                worker.rss_kb.append((now, rss))

    def stop(self) -> None:
        for index in list(self.live):
            worker = self.live[index]
            worker.process.terminate()
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            self.retired.append(self.live.pop(index))

    def rss_figures(self, warmup_s: float) -> dict[str, Any]:
        """The largest RSS seen, and the growth of the longest-lived process: its last sample
        over its first one after ``warmup_s`` (1.0 is flat)."""
        workers = [w for w in self.retired if w.rss_kb]
        if not workers:
            return {"rss_mb_max": None, "rss_growth": None, "rss_lifetime_s": None}
        peak = max(rss for w in workers for _, rss in w.rss_kb)
        longest = max(workers, key=lambda w: w.rss_kb[-1][0] - w.started)
        settled = [rss for t, rss in longest.rss_kb if t - longest.started >= warmup_s]
        growth = round(settled[-1] / settled[0], 3) if len(settled) >= 2 else None
        return {
            "rss_mb_max": round(peak / 1024, 1),
            "rss_growth": growth,
            "rss_lifetime_s": round(longest.rss_kb[-1][0] - longest.started, 1),
        }


def _create_effects_table(effects: str) -> None:
    if effects.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(effects, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {EFFECTS_TABLE} (id bigserial PRIMARY KEY, tag text NOT NULL, "
                "pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now())"
            )
        return
    with contextlib.closing(sqlite3.connect(effects)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            f"CREATE TABLE {EFFECTS_TABLE} (id INTEGER PRIMARY KEY, tag TEXT NOT NULL, "
            "pid INTEGER NOT NULL)"
        )
        conn.commit()


def _effect_counts(effects: str) -> Counter[str]:
    query = f"SELECT tag, count(*) FROM {EFFECTS_TABLE} GROUP BY tag"
    if effects.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(effects) as conn:
            rows = conn.execute(query).fetchall()
    else:
        with contextlib.closing(sqlite3.connect(effects)) as conn:
            rows = conn.execute(query).fetchall()
    return Counter({str(tag): int(count) for tag, count in rows})


def _memory_records(database: str) -> int:
    """The memory records the workers' agents wrote (0 when memory never opened its table)."""
    query = "SELECT count(*) FROM memory_records"
    try:
        if database.startswith("postgresql://"):
            import psycopg

            with psycopg.connect(database) as conn:
                row = conn.execute(query).fetchone()
        else:
            path = database.removeprefix("sqlite:///")
            with contextlib.closing(sqlite3.connect(path)) as conn:
                row = conn.execute(query).fetchone()
    except Exception:  # no such table: memory was never used
        return 0
    return int(row[0]) if row else 0


def _api_key(database: str) -> str:
    settings = load_settings()
    backends = Backends.open(database, settings=settings, memory=False, redis_url="")
    try:
        return APIKeys(backends.sql).create(_TENANT)
    finally:
        backends.close()


def _started_fleet(
    workers: int, directory: Path, database: str, effects: str, **options: Any
) -> tuple[_Fleet, str]:
    """The effects table made, an API key for the bench's tenant, and ``workers`` workers
    started on ``database`` with the worker ``options``; the fleet and the key."""
    _create_effects_table(effects)
    key = _api_key(database)
    fleet = _Fleet(workers, {"database": database, "effects": effects, **options}, directory)
    for index in range(workers):
        fleet.start(index)
    return fleet, key


@dataclass
class _Load:
    """One run's settings."""

    workers: int
    sessions: int
    duration_s: float
    kill_every_s: float
    model_latency_s: float
    lease_ttl_s: float
    think_s: float
    turn_timeout_s: float
    seed: int
    memory: bool = False


async def _reconcile(
    client: Any,
    url: str,
    sessions: int,
    effects: str,
    *,
    done: Counter[str] | None = None,
    argument: str = "tag",
) -> dict[str, int]:
    """The operator's pass: each in-doubt call (started, no result recorded: its worker died
    mid-call) is resolved from the effects table (or ``done``: the effects counted elsewhere,
    by the call's ``argument``), the source of truth for whether it ran."""
    entries = []
    for session in range(sessions):
        response = await client.get(f"{url}/v1/sessions/s{session}/in-doubt")
        response.raise_for_status()
        entries += response.json()
    done = _effect_counts(effects) if done is None else done
    took_effect = 0
    for entry in entries:
        tag = json.loads(entry["arguments"])[argument]
        happened = done[tag] > 0
        took_effect += happened
        verdict = {"ok": happened, "content": f"booked {tag}" if happened else "not booked"}
        response = await client.post(
            f"{url}/v1/tools/in-doubt/{entry['key']}/resolve", json=verdict
        )
        response.raise_for_status()
    left = 0
    for session in range(sessions):
        response = await client.get(f"{url}/v1/sessions/s{session}/in-doubt")
        left += len(response.json())
    return {"in_doubt": len(entries), "in_doubt_took_effect": took_effect, "in_doubt_left": left}


class _Driver:
    """The client side of one run: the sessions' turns, the kills, the RSS samples."""

    def __init__(
        self,
        fleet: _Fleet,
        load: _Load,
        client: httpx.AsyncClient,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.fleet = fleet
        self.load = load
        self.client = client
        self.progress = progress
        self.rng = random.Random(load.seed)
        self.statuses: Counter[str] = Counter()
        self.turns: list[_Turn] = []
        self.kill_windows: list[tuple[float, float]] = []
        self.answered: list[tuple[int, float, str]] = []
        """Each 200: the worker, when, the reply's text (the chaos run's recovery times)."""
        self.refused_s: list[float] = []
        """How long each 503 took to come back (a store that is down must fail fast)."""
        self.honour_retry_after = False
        """Wait a 503's ``Retry-After`` before sending the turn again (else 50-250 ms)."""
        self.round_robin = iter(range(1 << 62))
        self.started = time.monotonic()
        self.stop_at = self.started + load.duration_s
        self.finished = self.started

    async def run(self) -> int:
        """Every session until the run's end, under the kills; the number of kills."""
        sampler = asyncio.create_task(self._sample_rss())
        chaos_task = asyncio.create_task(self._chaos()) if self.load.kill_every_s > 0 else None
        await asyncio.gather(*(self._session_loop(s) for s in range(self.load.sessions)))
        self.finished = time.monotonic()
        kills = await chaos_task if chaos_task is not None else 0
        sampler.cancel()
        self.fleet.sample_rss()
        return kills

    async def _one_turn(self, session: int, tag: str) -> None:
        turn = _Turn(tag, time.monotonic())
        self.turns.append(turn)
        body = {"message": tag, "user": f"u{session}"}
        deadline = turn.started + self.load.turn_timeout_s
        while True:
            turn.attempts += 1
            index = next(self.round_robin) % self.load.workers
            url = self.fleet.url(index)
            sent_at = time.monotonic()
            try:
                response = await self.client.post(
                    f"{url}/v1/sessions/s{session}/turns",
                    json=body,
                    headers={"Idempotency-Key": tag},
                )
            except httpx.TransportError as exc:
                self.statuses[type(exc).__name__] += 1
            else:
                self.statuses[str(response.status_code)] += 1
                if response.status_code == 200:
                    reply = response.json()
                    turn.reply_status = reply["status"]
                    turn.ended = time.monotonic()
                    self.answered.append((index, turn.ended, str(reply.get("text") or "")))
                    return
                if response.status_code == 503:
                    self.refused_s.append(time.monotonic() - sent_at)
                    wait = response.headers.get("Retry-After", "")
                    if self.honour_retry_after and wait.isdigit():
                        await asyncio.sleep(int(wait) * self.rng.uniform(1.0, 1.5))
                if response.status_code not in (409, 429, 500, 502, 503):
                    turn.gave_up = True
                    turn.ended = time.monotonic()
                    return
            if time.monotonic() > deadline:
                turn.gave_up = True
                turn.ended = time.monotonic()
                return
            await asyncio.sleep(self.rng.uniform(0.05, 0.25))

    async def _session_loop(self, session: int) -> None:
        load = self.load
        # Sessions arrive spread over one turn and one think time, not all at once.
        spread = load.model_latency_s * _MODEL_CALLS_PER_TURN + 2 * load.think_s
        await asyncio.sleep(self.rng.uniform(0, spread))
        number = 0
        while time.monotonic() < self.stop_at:
            await self._one_turn(session, f"s{session}-t{number}")
            number += 1
            if load.think_s:
                await asyncio.sleep(self.rng.uniform(0, 2 * load.think_s))

    async def _chaos(self) -> int:
        kills = 0
        next_kill = self.started + self.load.kill_every_s
        while next_kill < self.stop_at:
            await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
            index = self.rng.randrange(self.load.workers)
            killed_at = time.monotonic()
            self.fleet.kill(index)
            kills += 1
            self.fleet.start(index)
            await self.fleet.ready(index, self.client)
            self.kill_windows.append((killed_at, time.monotonic()))
            if self.progress is not None:
                self.progress(f"killed worker {index} at {killed_at - self.started:.1f} s")
            next_kill += self.load.kill_every_s
        return kills

    async def _sample_rss(self) -> None:
        while time.monotonic() < self.stop_at + self.load.turn_timeout_s:
            self.fleet.sample_rss()
            await asyncio.sleep(1.0)


async def _drive(
    fleet: _Fleet,
    load: _Load,
    key: str,
    effects: str,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=load.sessions + 16, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60) as client:
        await asyncio.gather(*(fleet.ready(i, client) for i in range(load.workers)))
        driver = _Driver(fleet, load, client, progress)
        kills = await driver.run()
        held = await _committed(client, fleet.url(0), load.sessions, "s")
        reconciled = await _reconcile(client, fleet.url(0), load.sessions, effects)
    return {
        "turns": driver.turns,
        "statuses": driver.statuses,
        "kill_windows": driver.kill_windows,
        "kills": kills,
        "held": held,
        **reconciled,
        "elapsed_s": driver.finished - driver.started,
    }


def _figures(load: _Load, driven: dict[str, Any], effects: Counter[str]) -> dict[str, Any]:
    turns: list[_Turn] = driven["turns"]
    held: Counter[str] = driven["held"]
    sent = {turn.tag for turn in turns}
    model_ms = load.model_latency_s * _MODEL_CALLS_PER_TURN * 1000

    landed = [t for t in turns if t.reply_status is not None]
    windows: list[tuple[float, float]] = driven["kill_windows"]

    def added_ms(selected: list[_Turn]) -> list[float]:
        return [(t.ended - t.started) * 1000 - model_ms for t in selected]

    def in_a_kill_window(turn: _Turn) -> bool:
        return any(turn.started < ready and turn.ended > killed for killed, ready in windows)

    # A turn a kill touched directly needed another attempt: its worker died under it (and the
    # retry waited for the dead worker's lease), or it was sent to a worker still restarting.
    first_attempt = [t for t in landed if t.attempts == 1]
    # A kill window runs from the SIGKILL until the restarted worker answers; its start-up
    # (imports, pools) takes most of one of the two cores, so turns on the other workers queue
    # behind it too.
    calm = [t for t in first_attempt if not in_a_kill_window(t)]

    def quantiles(values: list[float]) -> dict[str, float | int]:
        return {
            "p50": round(nearest_rank(values, 0.50), 2),
            "p95": round(nearest_rank(values, 0.95), 2),
            "p99": round(nearest_rank(values, 0.99), 2),
            "turns": len(values),
        }

    completed = {t.tag for t in landed if t.reply_status == "completed"}
    return {
        "workers": load.workers,
        "sessions": load.sessions,
        "duration_s": load.duration_s,
        "model_latency_ms": load.model_latency_s * 1000,
        "think_s": load.think_s,
        "memory": load.memory,
        "turns_sent": len(sent),
        "turns_committed": sum(1 for tag in sent if held[tag] >= 1),
        "turns_per_s": round(sum(1 for tag in sent if held[tag] >= 1) / driven["elapsed_s"], 2),
        "keel_added_ms": quantiles(added_ms(calm)),
        "keel_added_ms_first_attempt": quantiles(added_ms(first_attempt)),
        "keel_added_ms_all_turns": quantiles(added_ms(landed)),
        "retried_turns": sum(1 for t in turns if t.attempts > 1),
        "status_counts": dict(sorted(driven["statuses"].items())),
        "reply_statuses": dict(Counter(t.reply_status or "none" for t in turns)),
        "kills": driven["kills"],
        "restart_s_p50": round(nearest_rank([r - k for k, r in windows], 0.5), 2),
        "kill_windows_s": round(sum(r - k for k, r in windows), 1),
        "lost_turns": sum(1 for tag in sent if held[tag] == 0),
        "duplicated_turns": sum(1 for tag in sent if held[tag] > 1),
        "double_effects": sum(1 for count in effects.values() if count > 1),
        "missing_effects": sum(1 for tag in completed if effects[tag] == 0),
        "effects_without_turn": sum(1 for tag in effects if held[tag] == 0),
        "in_doubt": driven["in_doubt"],
        "in_doubt_took_effect": driven["in_doubt_took_effect"],
        "in_doubt_left": driven["in_doubt_left"],
        "gave_up": sum(1 for t in turns if t.gave_up),
    }


def _run(
    database: str,
    effects: str,
    redis_url: str | None,
    load: _Load,
    directory: Path,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    fleet, key = _started_fleet(
        load.workers,
        directory,
        database,
        effects,
        redis_url=redis_url,
        model_latency_s=load.model_latency_s,
        lease_ttl_s=load.lease_ttl_s,
        memory=load.memory,
    )
    # This client's full collections would stall every session's clock at once, counted as
    # keel's time: the collector scans only what the run adds, and sees the rest again after.
    gc.collect()
    gc.freeze()
    try:
        driven = asyncio.run(_drive(fleet, load, key, effects, progress))
    finally:
        gc.unfreeze()
        fleet.stop()
    figures = _figures(load, driven, _effect_counts(effects))
    figures.update(fleet.rss_figures(warmup_s=5.0))
    if load.memory:
        figures["memory_records"] = _memory_records(database)
    return figures


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="keel-bench-serve-") as name:
        yield Path(name)


def run_serve_bench(
    *,
    workers: int = 4,
    sessions: int = 200,
    duration_s: float = 60.0,
    kill_every_s: float = 5.0,
    model_latency_ms: float = 300.0,
    lease_ttl_s: float = 2.0,
    think_s: float = 0.0,
    turn_timeout_s: float = 60.0,
    seed: int = 7,
    sqlite: bool = True,
    memory: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the load on PostgreSQL + Redis with ``workers`` workers, then (``sqlite``) on SQLite
    with one; the figures of the first, with the second's under ``"sqlite"``. ``memory``: the
    workers' agents have long-term memory (the embedder the settings name)."""
    load = _Load(
        workers,
        sessions,
        duration_s,
        kill_every_s,
        model_latency_ms / 1000,
        lease_ttl_s,
        think_s,
        turn_timeout_s,
        seed,
        memory,
    )
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(_folder())
        server = stack.enter_context(postgres_server())
        url = stack.enter_context(server.throwaway_database())
        redis = stack.enter_context(redis_server())
        if progress is not None:
            progress(f"PostgreSQL + Redis, {workers} workers, {sessions} sessions")
        figures = _run(url, url, redis, load, directory, progress)
    if sqlite:
        single = _Load(**{**load.__dict__, "workers": 1})
        with _folder() as directory:
            if progress is not None:
                progress(f"SQLite, 1 worker, {sessions} sessions")
            database = f"sqlite:///{directory / 'keel.db'}"
            figures["sqlite"] = _run(
                database, str(directory / "effects.db"), None, single, directory, progress
            )
    figures["seed"] = seed
    return figures


# --- keel bench serve --hostile ---------------------------------------------------------------

_HOSTILE_PATHS = ("/v1/sessions/h{n}/turns", "/v1/chat/completions", "/v1/memory")
_FLOOD_PIECE = 64 * 1024


@dataclass
class _HostileLoad:
    """The hostile run's settings."""

    clients: int
    body_bytes: int
    duration_s: float
    sessions: int
    model_latency_s: float
    think_s: float
    body_timeout_s: float
    seed: int
    baseline_s: float = 10.0


def _head(method: str, path: str, key: str, framing: str) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {key}",
        "Content-Type: application/json",
        "X-Keel-Session: h",
        "X-Keel-User: h",
        framing,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _answer(
    writer: asyncio.StreamWriter, answer: asyncio.Task[bytes], timeout_s: float
) -> str:
    """The status line's code of a raw request's answer, or what happened instead."""
    try:
        head = await asyncio.wait_for(answer, timeout_s)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    except TimeoutError:
        return "no_answer"
    finally:
        writer.close()
    return head.split(b" ", 2)[1].decode("ascii", "replace")


async def _flood(port: int, key: str, path: str, body_bytes: int, timeout_s: float) -> str:
    """One request whose chunked body is ``body_bytes`` long, sent as fast as the server
    reads it, until the server answers; its status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("POST", path, key, "Transfer-Encoding: chunked"))
    answer = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
    chunk = f"{_FLOOD_PIECE:x}\r\n".encode() + b"x" * _FLOOD_PIECE + b"\r\n"
    sent = 0
    try:
        while sent < body_bytes and not answer.done():
            writer.write(chunk)
            await writer.drain()
            sent += _FLOOD_PIECE
        if not answer.done():
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except ConnectionError:
        pass  # the server answered and closed: the answer may still be there to read
    return await _answer(writer, answer, timeout_s)


async def _trickle(port: int, key: str, path: str, timeout_s: float) -> str:
    """One request that declares a 1 kB body and sends a byte of it a second; its status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("POST", path, key, "Content-Length: 1000") + b'{"m')
    answer = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(1000 - 3):
            if answer.done() or time.monotonic() > deadline:
                break
            writer.write(b" ")
            await writer.drain()
            await asyncio.wait({answer}, timeout=1.0)
    except ConnectionError:
        pass
    return await _answer(writer, answer, max(0.1, deadline - time.monotonic()))


async def _hostile_clients(
    port: int, key: str, load: _HostileLoad, stop_at: float
) -> dict[str, int]:
    """``load.clients`` clients, each sending floods and trickles in turn until ``stop_at``
    (this process's ``time.time()``): the statuses they got."""
    statuses: Counter[str] = Counter()
    timeout_s = load.body_timeout_s + 30

    async def client(number: int) -> None:
        rng = random.Random(load.seed * 1000 + number)
        while time.time() < stop_at:
            path = rng.choice(_HOSTILE_PATHS).format(n=number)
            try:
                if rng.random() < 0.5:
                    status = await _flood(port, key, path, load.body_bytes, timeout_s)
                else:
                    status = await _trickle(port, key, path, timeout_s)
            except OSError as exc:
                status = type(exc).__name__
            statuses[status] += 1

    await asyncio.gather(*(client(n) for n in range(load.clients)))
    return dict(statuses)


def _hostile_process(port: int, key: str, load: _HostileLoad, stop_at: float) -> dict[str, int]:
    """The hostile clients in a process of their own: their sending would otherwise hold up
    the loop that times ``/health``."""
    return asyncio.run(_hostile_clients(port, key, load, stop_at))


def _reset_peak_rss(pid: int) -> bool:
    """Start the kernel's peak-RSS count (``VmHWM``) of ``pid`` afresh from now."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


async def _one_turn(client: Any, url: str, session: int, tag: str) -> None:
    """One turn of a normal session, retried (same idempotency key) on a dropped connection,
    409 or 503 until it lands or a minute passes."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            response = await client.post(
                f"{url}/v1/sessions/n{session}/turns",
                json={"message": tag, "user": f"u{session}"},
                headers={"Idempotency-Key": tag},
            )
        except httpx.TransportError:
            await asyncio.sleep(0.1)
            continue
        if response.status_code not in (409, 429, 503):
            return
        await asyncio.sleep(0.1)


async def _normal_session(
    client: Any, url: str, session: int, stop_at: float, sent: list[str], think_s: float
) -> None:
    """A session's turns until ``stop_at``, each after a pause of ``think_s`` on average."""
    rng = random.Random(session)
    number = 0
    while time.monotonic() < stop_at:
        await asyncio.sleep(rng.uniform(0, 2 * think_s))
        tag = f"n{session}-t{number}"
        sent.append(tag)
        await _one_turn(client, url, session, tag)
        number += 1


async def _committed(client: Any, url: str, sessions: int, prefix: str) -> Counter[str]:
    """How often each tag is held in its session's final state (sessions ``{prefix}0``...)."""
    held: Counter[str] = Counter()
    for session in range(sessions):
        response = await client.get(f"{url}/v1/sessions/{prefix}{session}")
        if response.status_code == 200:
            for message in response.json()["state"]["messages"]:
                if message["role"] == "user":
                    held[message["content"]] += 1
    return held


@dataclass
class _Phase:
    """What one phase of the hostile run measured."""

    health_ms: list[float] = field(default_factory=list)
    rss_kb: list[int] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)


async def _phase(
    client: Any, url: str, pid: int, load: _HostileLoad, key: str | None, sent: list[str]
) -> _Phase:
    """The normal sessions and a ``/health`` probe (every 50 ms) for ``load.duration_s``, with
    the hostile clients (in a process of their own) when ``key`` is given."""
    measured = _Phase()
    stop_at = time.monotonic() + load.duration_s

    async def probe_health() -> None:
        async with httpx.AsyncClient(timeout=30) as prober:
            while time.monotonic() < stop_at:
                began = time.perf_counter()
                response = await prober.get(f"{url}/health")
                if response.status_code == 200:
                    measured.health_ms.append((time.perf_counter() - began) * 1000)
                measured.rss_kb.append(_rss_kb(pid) or 0)
                await asyncio.sleep(0.05)

    normal = [
        _normal_session(client, url, s, stop_at, sent, load.think_s) for s in range(load.sessions)
    ]
    if key is None:
        await asyncio.gather(probe_health(), *normal)
        return measured
    port = int(url.rsplit(":", 1)[1])
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        hostile = asyncio.get_running_loop().run_in_executor(
            pool, _hostile_process, port, key, load, time.time() + load.duration_s
        )
        await asyncio.gather(probe_health(), *normal)
        measured.statuses = await hostile
    return measured


async def _drive_hostile(
    fleet: _Fleet, load: _HostileLoad, key: str, progress: Callable[[str], None] | None
) -> dict[str, Any]:
    url, pid = fleet.url(0), fleet.live[0].process.pid
    headers = {"Authorization": f"Bearer {key}"}
    sent: list[str] = []
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        await fleet.ready(0, client)
        # Warm (the imports and pools a first turn opens), then the normal load alone: what
        # /health answers in on this machine without a hostile client.
        await asyncio.gather(
            *(_one_turn(client, url, s, f"n{s}-warm") for s in range(load.sessions))
        )
        baseline_load = _HostileLoad(**{**load.__dict__, "duration_s": load.baseline_s})
        baseline = await _phase(client, url, pid, baseline_load, None, sent)
        await asyncio.sleep(1.0)
        idle_kb = _rss_kb(pid) or 0
        kernel_peak = _reset_peak_rss(pid)
        if progress is not None:
            progress(f"idle RSS {idle_kb / 1024:.0f} MB; {load.clients} hostile clients start")
        hostile = await _phase(client, url, pid, load, key, sent)
        held = await _committed(client, url, load.sessions, "n")
    peak_kb = max([*hostile.rss_kb, (_rss_kb(pid, "VmHWM") or 0) if kernel_peak else 0])
    return {
        "idle_kb": idle_kb,
        "peak_kb": peak_kb,
        "kernel_peak": kernel_peak,
        "health_ms": hostile.health_ms,
        "baseline_health_ms": baseline.health_ms,
        "sent": sent,
        "held": held,
        "statuses": hostile.statuses,
    }


def run_hostile_bench(
    *,
    clients: int = 20,
    body_mb: float = 10.0,
    duration_s: float = 30.0,
    sessions: int = 8,
    model_latency_ms: float = 300.0,
    think_s: float = 0.5,
    body_timeout_s: float = 5.0,
    baseline_s: float | None = None,
    seed: int = 7,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One worker on SQLite, serving ``sessions`` normal sessions (a turn after ``think_s`` on
    average, the model answering in ``model_latency_ms``) while ``clients`` hostile
    clients send it ``body_mb`` MB chunked bodies and bodies a byte a second: whether every
    normal turn committed, the worker's peak RSS over its idle RSS, ``/health`` latency, and
    what the hostile requests got; first, ``baseline_s`` (default: a third of ``duration_s``,
    at most 10 s) of the normal sessions alone (the ``/health`` latency this machine gives
    without a hostile client)."""
    load = _HostileLoad(
        clients,
        int(body_mb * 1_000_000),
        duration_s,
        sessions,
        model_latency_ms / 1000,
        think_s,
        body_timeout_s,
        seed,
        baseline_s if baseline_s is not None else min(10.0, duration_s / 3),
    )
    with _folder() as directory:
        database = f"sqlite:///{directory / 'keel.db'}"
        effects = str(directory / "effects.db")
        fleet, key = _started_fleet(
            1,
            directory,
            database,
            effects,
            redis_url=None,
            model_latency_s=load.model_latency_s,
            lease_ttl_s=2.0,
            body_timeout_s=body_timeout_s,
        )
        try:
            driven = asyncio.run(_drive_hostile(fleet, load, key, progress))
        finally:
            fleet.stop()
    return _hostile_figures(load, driven)


def _hostile_figures(load: _HostileLoad, driven: dict[str, Any]) -> dict[str, Any]:
    held: Counter[str] = driven["held"]
    sent: list[str] = driven["sent"]
    statuses: dict[str, int] = driven["statuses"]
    health: list[float] = driven["health_ms"]
    return {
        "hostile_clients": load.clients,
        "hostile_body_mb": load.body_bytes / 1_000_000,
        "duration_s": load.duration_s,
        "body_timeout_s": load.body_timeout_s,
        "idle_rss_mb": round(driven["idle_kb"] / 1024, 1),
        "peak_rss_mb": round(driven["peak_kb"] / 1024, 1),
        "peak_rss_ratio": round(driven["peak_kb"] / max(1, driven["idle_kb"]), 3),
        "peak_rss_from_kernel": driven["kernel_peak"],
        "normal_sessions": load.sessions,
        "model_latency_ms": load.model_latency_s * 1000,
        "think_s": load.think_s,
        "normal_turns_sent": len(sent),
        "normal_turns_committed": sum(1 for tag in sent if held[tag] >= 1),
        "normal_turns_lost": sum(1 for tag in sent if held[tag] == 0),
        "normal_turns_duplicated": sum(1 for tag in sent if held[tag] > 1),
        "health_probes": len(health),
        "health_p50_ms": round(nearest_rank(health, 0.50), 2),
        "health_p99_ms": round(nearest_rank(health, 0.99), 2),
        "health_max_ms": round(max(health, default=0.0), 2),
        "health_p99_ms_without_hostile": round(nearest_rank(driven["baseline_health_ms"], 0.99), 2),
        "hostile_requests": sum(statuses.values()),
        "refused_413": statuses.get("413", 0),
        "timed_out_408": statuses.get("408", 0),
        "hostile_statuses": dict(sorted(statuses.items())),
    }
