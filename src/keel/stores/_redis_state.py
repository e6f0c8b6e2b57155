"""State checkpoints in Redis (redis-py), with compare-and-set in Lua and native TTLs.

Each session lives in three keys sharing a hash tag (so a Redis Cluster keeps them on one slot
and the Lua scripts stay atomic there: ``redis+cluster://`` URLs get redis-py's cluster-aware
client): ``head`` (version, epoch, ttl, expiry), ``rows`` (per
version: ``m:V`` metadata, ``p:V`` payload, ``g:V`` good mark) and ``fulls`` (versions stored as
full snapshots). A session with a TTL has its keys expire natively at ``expires_at``; a small
``tomb`` key outlives them by ``tombstone_s`` so an expired read can say "expired" rather than
"absent".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from keel.errors import (
    BackendUnavailableError,
    ConfigError,
    ConflictError,
    ExpiredError,
    StoreError,
)
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.state._erasure import LEASE_KEY_PREFIX
from keel.state._twins import backend_call, sync_twin
from keel.stores._redis_client import (
    RedisDurability,
    async_redis_client,
    durability_problems,
    is_cluster_url,
    redis_client,
)

__all__ = ["RedisStateBackend"]

logger = logging.getLogger("keel.stores")

_WRITE = """
local now = tonumber(ARGV[9])
local h = redis.call('HMGET', KEYS[1], 'version', 'epoch', 'expires_at', 'ttl')
local live = h[1] and ((not h[3]) or h[3] == '' or tonumber(h[3]) > now)
local ttl
if ARGV[1] == 'create' then
  if live then return {'conflict', h[1]} end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
  ttl = ARGV[8]
  redis.call('HSET', KEYS[1], 'version', ARGV[5], 'epoch', ARGV[4], 'last_full', ARGV[5],
             'ttl', ttl)
else
  if (not live) or h[1] ~= ARGV[2] or h[2] ~= ARGV[3] then return {'conflict', h[1] or ''} end
  ttl = h[4] or ''
  redis.call('HSET', KEYS[1], 'version', ARGV[5])
  if ARGV[7] == 'full' then redis.call('HSET', KEYS[1], 'last_full', ARGV[5]) end
end
redis.call('HSET', KEYS[2], 'm:' .. ARGV[5], ARGV[6], 'p:' .. ARGV[5], ARGV[11])
if ARGV[12] ~= '' then redis.call('HSET', KEYS[2], 'g:' .. ARGV[5], ARGV[12]) end
if ARGV[7] == 'full' then redis.call('ZADD', KEYS[3], ARGV[5], ARGV[5]) end
if ttl ~= '' then
  local exp = now + tonumber(ttl)
  local ms = math.floor(exp * 1000)
  redis.call('HSET', KEYS[1], 'expires_at', string.format('%.6f', exp))
  redis.call('PEXPIREAT', KEYS[1], ms)
  redis.call('PEXPIREAT', KEYS[2], ms)
  redis.call('PEXPIREAT', KEYS[3], ms)
  redis.call('SET', KEYS[4], string.format('%.6f', exp), 'PX',
             math.max(1, ms - math.floor(now * 1000) + tonumber(ARGV[10])))
end
return {'ok'}
"""

_LIVE_HEAD = """
local h = redis.call('HMGET', KEYS[1], 'version', 'epoch', 'last_full', 'ttl', 'expires_at')
if not h[1] then
  local t = redis.call('GET', KEYS[4])
  if t then return {'expired', t} end
  return {'absent'}
end
if h[5] and h[5] ~= '' and tonumber(h[5]) <= now then return {'expired', h[5]} end
"""
"""The head of a live session as ``h`` (version, epoch, last_full, ttl, expires_at), given
``now``; an expired one (its tombstone, once its keys are gone) or an absent one returns."""

_READ = (
    """
local now = tonumber(ARGV[2])"""
    + _LIVE_HEAD
    + """local target = tonumber(h[1])
if ARGV[1] ~= '' then target = tonumber(ARGV[1]) end
if target > tonumber(h[1]) or target < 1 then return {'absent'} end
local function rows(first)
  local out = {'ok', h[1], h[2], h[3], h[4] or '', h[5] or ''}
  for v = first, target do
    local s = tostring(v)
    local r = redis.call('HMGET', KEYS[2], 'm:' .. s, 'p:' .. s, 'g:' .. s)
    if not r[1] then return nil end
    out[#out + 1] = s
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3] or ''
  end
  return out
end
if ARGV[1] == '' and ARGV[3] and ARGV[4] == h[2] and tonumber(ARGV[3]) <= target then
  -- The caller holds a version of this incarnation: the head, whose row alone it needs (a
  -- flat cost however long the chain), or an older one, which it catches up from the rows
  -- after it (from the newest full snapshot among them, if any). Rows missing there (a
  -- retention ran): the whole chain, below.
  local known = tonumber(ARGV[3])
  local first = known
  if known < target then
    first = known + 1
    local full = redis.call('ZREVRANGEBYSCORE', KEYS[3], target, '(' .. known, 'LIMIT', 0, 1)
    if #full > 0 then first = tonumber(full[1]) end
  end
  local out = rows(first)
  if out then return out end
end
local base = redis.call('ZREVRANGEBYSCORE', KEYS[3], target, '-inf', 'LIMIT', 0, 1)
if #base == 0 then return {'absent'} end
return rows(tonumber(base[1])) or {'absent'}
"""
)

_HISTORY = (
    """
local now = tonumber(ARGV[1])"""
    + _LIVE_HEAD
    + """local out = {'ok'}
for v = 1, tonumber(h[1]) do
  local s = tostring(v)
  local m = redis.call('HGET', KEYS[2], 'm:' .. s)
  if m then
    out[#out + 1] = s
    out[#out + 1] = m
    out[#out + 1] = redis.call('HSTRLEN', KEYS[2], 'p:' .. s)
    out[#out + 1] = redis.call('HGET', KEYS[2], 'g:' .. s) or ''
  end
end
return out
"""
)

_MARK = """
if redis.call('HEXISTS', KEYS[1], 'm:' .. ARGV[1]) == 0 then return 0 end
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], 'g:' .. ARGV[1])
else redis.call('HSET', KEYS[1], 'g:' .. ARGV[1], ARGV[2]) end
return 1
"""

_REWRITE = """
local head = redis.call('HGET', KEYS[1], 'version')
if not head then return 0 end
local n = tonumber(ARGV[1])
local i = 2
for _ = 1, n do
  local v = ARGV[i]
  redis.call('HSET', KEYS[2], 'p:' .. v, ARGV[i + 1], 'm:' .. v, ARGV[i + 2])
  redis.call('ZADD', KEYS[3], v, v)
  i = i + 3
end
while ARGV[i] do
  local v = ARGV[i]
  if v ~= head then
    redis.call('HDEL', KEYS[2], 'm:' .. v, 'p:' .. v, 'g:' .. v)
    redis.call('ZREM', KEYS[3], v)
  end
  i = i + 1
end
return 1
"""

_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_SADD = "return redis.call('SADD', KEYS[1], ARGV[1])"

_DELETE = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
if KEYS[5] then redis.call('SREM', KEYS[5], ARGV[1]) end
return existed
"""

_SREM = "return redis.call('SREM', KEYS[1], ARGV[1])"

_SCRIPTS = {
    "write": _WRITE,
    "read": _READ,
    "history": _HISTORY,
    "mark": _MARK,
    "rewrite": _REWRITE,
    "acquire": _ACQUIRE,
    "release": _RELEASE,
    "sadd": _SADD,
    "srem": _SREM,
    "delete": _DELETE,
}

_WAITED = frozenset({"write", "mark", "rewrite", "delete", "sadd", "srem"})
"""The scripts that change a session's state: acknowledged only once ``wait_replicas``
replicas have them, when a deployment asks for that. Leases are not waited for: a lease lost in
a failover lets a second writer in, whose write the version check then rejects."""

_REDIRECTS = 40
"""Tries of one waited script while the cluster redirects it (a slot moving, a failover under
way): each error of that kind says the script did not run, so trying again is safe."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _meta(row: StoredCheckpoint) -> str:
    return json.dumps(
        {
            "t": row.created_at,
            "s": row.step,
            "r": row.reason,
            "k": row.kind,
            "n": row.schema_name,
            "sv": row.schema_version,
            "f": row.forked_from,
        },
        separators=(",", ":"),
    )


def _from_meta(
    version: int, meta: str, payload: str, good: str, size: int | None = None
) -> StoredCheckpoint:
    data = json.loads(meta)
    return StoredCheckpoint(
        version=version,
        created_at=float(data["t"]),
        step=int(data["s"]),
        reason=str(data["r"]),
        kind="full" if data["k"] == "full" else "delta",
        payload=payload,
        schema_name=str(data["n"]),
        schema_version=int(data["sv"]),
        good=None if good == "" else good == "1",
        forked_from=data.get("f"),
        payload_size=size,
    )


def _expired(session_id: str, expires_at: Any, now: float) -> ExpiredError:
    ago = now - float(_text(expires_at))
    return ExpiredError(f"session {session_id!r} expired {ago:.1f}s ago; it reads as absent")


def _chain_from(session_id: str, found: Any, now: float) -> Chain | None:
    """The chain the read script returned."""
    status = _text(found[0])
    if status == "absent":
        return None
    if status == "expired":
        raise _expired(session_id, found[1], now)
    ttl, expires_at = _text(found[4]), _text(found[5])
    head = SessionHead(
        session_id=session_id,
        version=int(found[1]),
        epoch=_text(found[2]),
        last_full=int(found[3]),
        ttl=float(ttl) if ttl else None,
        expires_at=float(expires_at) if expires_at else None,
    )
    rows = [
        _from_meta(int(found[i]), _text(found[i + 1]), _text(found[i + 2]), _text(found[i + 3]))
        for i in range(6, len(found), 4)
    ]
    return Chain(head, rows)


def _history_from(session_id: str, found: Any, now: float) -> list[StoredCheckpoint]:
    """The rows (payloads left out) the history script returned."""
    status = _text(found[0])
    if status == "absent":
        return []
    if status == "expired":
        raise _expired(session_id, found[1], now)
    return [
        _from_meta(int(found[i]), _text(found[i + 1]), "", _text(found[i + 3]), int(found[i + 2]))
        for i in range(1, len(found), 4)
    ]


def _check_write(session_id: str, expected_version: int | None, result: Any) -> None:
    if _text(result[0]) == "conflict":
        actual = _text(result[1]) if len(result) > 1 else ""
        raise ConflictError(session_id, expected_version, int(actual) if actual else None)


def _flag(good: bool | None) -> str:
    return "" if good is None else ("1" if good else "0")


_WARNED_NOT_DURABLE: set[str] = set()
"""The durability warnings this process logged (each Redis's, as its problems read)."""


class _RedisScripts:
    """keel's Lua scripts on one Redis, through a sync client and, per event loop, an async one
    (redis.asyncio clients belong to one loop); driver errors translated into keel's."""

    def __init__(self, url: str, durability: RedisDurability | None = None) -> None:
        try:
            import redis  # the 'redis' extra: optional, so imported only when Redis is used
            from redis.exceptions import RedisClusterException
        except ImportError as exc:  # pragma: no cover - the extra is installed in tests
            raise BackendUnavailableError("redis-py is not installed (the 'redis' extra)") from exc
        self._redis = redis
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
        self.url = url
        self.cluster = is_cluster_url(url)
        self.durability = durability or RedisDurability()
        host = url.rpartition("@")[2]
        try:
            # A cluster client reads the slot map from a start-up node as it is made.
            self.client = redis_client(url, socket_timeout=30, health_check_interval=30)
            self.client.ping()
        except (redis.RedisError, RedisClusterException) as exc:
            client = getattr(self, "client", None)
            if client is not None:
                client.close()
            raise BackendUnavailableError(f"Redis at {host} is unavailable: {exc}") from exc
        if self.durability.policy != "off":
            self._check_durability(host)
        self._scripts = {
            name: self.client.register_script(source) for name, source in _SCRIPTS.items()
        }
        self._aclient: Any = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._ascripts: dict[str, Any] = {}
        self._anodes: dict[str, Any] = {}
        self._stale_topology = False

    def _check_durability(self, host: str) -> None:
        """Refuse (policy ``require``) or log (``warn``) a Redis that can lose acknowledged
        state writes."""
        try:
            problems = durability_problems(self.client, self.durability.wait_replicas)
        except self._redis.RedisError as exc:
            problems = [f"its persistence settings cannot be read ({exc})"]
        if not problems:
            return
        what = (
            f"Redis at {host} can lose acknowledged state writes: " + "; ".join(problems) + " "
            "(docs/deployment.md, 'Redis Cluster': appendonly yes, appendfsync always, and "
            "KEEL_REDIS_WAIT_REPLICAS replicas per primary)"
        )
        if self.durability.policy == "require":
            self.client.close()
            raise ConfigError(what + "; KEEL_REDIS_DURABILITY=require refuses it")
        # Once per process: a served agent's factory opens the stores, then the service its
        # own (and a factory per tenant, once each); the operator needs to read it once.
        if what not in _WARNED_NOT_DURABLE:
            _WARNED_NOT_DURABLE.add(what)
            logger.warning("%s", what)

    def _translated(self, exc: Exception) -> Exception:
        redis = self._redis
        if isinstance(exc, redis.TimeoutError):
            return BackendUnavailableError(f"Redis timed out: {exc}", store="redis")
        if isinstance(exc, redis.ConnectionError):
            return BackendUnavailableError(f"Redis is unavailable: {exc}", store="redis")
        if isinstance(
            exc,
            (
                redis.exceptions.ClusterDownError,
                redis.exceptions.ClusterError,
                redis.exceptions.RedisClusterException,
            ),
        ) or str(exc).startswith(("MASTERDOWN", "TRYAGAIN")):
            return BackendUnavailableError(f"Redis Cluster is unavailable: {exc}", store="redis")
        return StoreError(f"Redis: {exc}")

    def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run the script ``name`` on the sync client: routed by keel on a cluster, and a
        state change waited for by ``wait_replicas`` replicas when set."""
        if self.cluster or self._waits(name):
            return self._call_routed(name, keys, args)
        return self.run(self._scripts[name], keys=keys, args=args)

    def _waits(self, name: str) -> bool:
        return name in _WAITED and self.durability.wait_replicas > 0

    def _call_routed(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """The script, then ``WAIT`` when it waits, pipelined on one connection (WAIT counts
        the replicas that have this connection's writes): on a cluster, a connection to the
        primary of the keys' slot, following its redirections for longer than redis-py would
        (a write to a slot half-moved waits, TRYAGAIN, until the move ends)."""
        asking: tuple[str, int] | None = None
        for attempt in range(_REDIRECTS):
            try:
                if self._stale_topology and self.cluster:
                    self.client.nodes_manager.initialize()
                    self._stale_topology = False
                pipe = self._node_client(keys[0], asking).pipeline(transaction=False)
                if asking is not None:
                    pipe.execute_command("ASKING")
                self._scripts[name](keys=keys, args=args, client=pipe)
                if self._waits(name):
                    pipe.wait(self.durability.wait_replicas, self.durability.wait_timeout_ms)
                results = pipe.execute(raise_on_error=False)
            except self._errors as exc:
                self._stale_topology = True
                raise self._translated(exc) from exc
            redirect = self._redirect(results[1 if asking else 0])
            if redirect is None:
                return self._acknowledged(name, results, asking is not None)
            asking = redirect if isinstance(redirect, tuple) else None
            if redirect == "later":
                time.sleep(min(0.5, 0.02 * (attempt + 1)))
        raise BackendUnavailableError(
            f"Redis kept redirecting a state operation ({_REDIRECTS} tries): the cluster is "
            "reconfiguring"
        )

    def _node_client(self, key: str, asking: tuple[str, int] | None) -> Any:
        if not self.cluster:
            return self.client
        if asking is not None:
            node = self.client.get_node(host=asking[0], port=asking[1])
            if node is None:
                self.client.nodes_manager.initialize()
                node = self.client.get_node(host=asking[0], port=asking[1])
        else:
            node = self.client.get_node_from_key(key)
        return self.client.get_redis_connection(node)

    def _redirect(self, result: Any) -> tuple[str, int] | str | None:
        """What a waited script's result says: None (it ran, or failed for good), an ASK
        target, or ``"moved"`` / ``"later"`` (the slot map changed; the cluster is busy):
        try again."""
        redis = self._redis
        if isinstance(result, redis.exceptions.AskError):
            return (result.host, result.port)
        if isinstance(result, redis.exceptions.MovedError):
            self._stale_topology = True
            return "moved"
        if isinstance(
            result, (redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
        ) or (isinstance(result, redis.ResponseError) and str(result).startswith("MASTERDOWN")):
            self._stale_topology = True
            return "later"
        return None

    def _acknowledged(self, name: str, results: list[Any], asked: bool) -> Any:
        """The script's result, once the replicas WAIT counted (if it waits) are enough."""
        result = results[1 if asked else 0]
        if isinstance(result, Exception):
            raise self._translated(result) from result
        if not self._waits(name):
            return result
        replicas = results[-1]
        if isinstance(replicas, Exception):
            raise self._translated(replicas) from replicas
        if int(replicas) < self.durability.wait_replicas:
            raise BackendUnavailableError(
                f"a state write reached {int(replicas)} of the "
                f"{self.durability.wait_replicas} Redis replicas it waits for within "
                f"{self.durability.wait_timeout_ms} ms: not acknowledged (the primary has it; "
                "a failover now may lose it)"
            )
        return result

    async def script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run the script ``name``: inline on the sync client inside a sync twin, else on
        this loop's async client."""
        return await backend_call(self.call, self.acall, name, keys, args)

    def run(self, command: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a client command (or script)."""
        try:
            return command(*args, **kwargs)
        except self._errors as exc:
            raise self._translated(exc) from exc

    async def acall(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run the script ``name`` on this event loop's async client."""
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:
            self._aclient = async_redis_client(self.url, socket_timeout=30)
            self._aloop = loop
            self._anodes = {}
            self._ascripts = {
                name: self._aclient.register_script(source) for name, source in _SCRIPTS.items()
            }
        try:
            if self.cluster or self._waits(name):
                return await self._acall_routed(name, keys, args)
            return await self._ascripts[name](keys=keys, args=args)
        except self._errors as exc:
            raise self._translated(exc) from exc

    async def _acall_routed(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Async twin of ``_call_routed``, on per-node clients of this loop (redis.asyncio's
        cluster client lends no connection of its own for a pipeline on one node)."""
        asking: tuple[str, int] | None = None
        for attempt in range(_REDIRECTS):
            try:
                pipe = (await self._anode_client(keys[0], asking)).pipeline(transaction=False)
                if asking is not None:
                    pipe.execute_command("ASKING")
                await self._ascripts[name](keys=keys, args=args, client=pipe)
                if self._waits(name):
                    pipe.wait(self.durability.wait_replicas, self.durability.wait_timeout_ms)
                results = await pipe.execute(raise_on_error=False)
            except self._errors:
                self._stale_topology = True
                raise
            redirect = self._redirect(results[1 if asking else 0])
            if redirect is None:
                return self._acknowledged(name, results, asking is not None)
            asking = redirect if isinstance(redirect, tuple) else None
            if redirect == "later":
                await asyncio.sleep(min(0.5, 0.02 * (attempt + 1)))
        raise BackendUnavailableError(
            f"Redis kept redirecting a state operation ({_REDIRECTS} tries): the cluster is "
            "reconfiguring"
        )

    async def _anode_client(self, key: str, asking: tuple[str, int] | None) -> Any:
        if not self.cluster:
            return self._aclient
        from redis import asyncio as aredis

        if self._stale_topology:
            await self._aclient.nodes_manager.initialize()
            self._stale_topology = False
        if asking is not None:
            host, port = asking
        else:
            if not self._aclient.nodes_manager.slots_cache:
                await self._aclient.initialize()
            node = self._aclient.get_node_from_key(key)
            host, port = node.host, node.port
        address = f"{host}:{port}"
        if address not in self._anodes:
            self._anodes[address] = aredis.Redis(
                host=host, port=port, socket_timeout=30, **self._anode_options()
            )
        return self._anodes[address]

    def _anode_options(self) -> dict[str, Any]:
        kwargs = self._aclient.connection_kwargs
        return {k: kwargs[k] for k in ("username", "password", "ssl") if kwargs.get(k)}

    async def aclose(self) -> None:
        """Close the async clients (of the loop that made them) and the sync one."""
        for node in self._anodes.values():
            await node.aclose()
        self._anodes = {}
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        self.client.close()


class RedisStateBackend(StateBackend):
    """Checkpoints in Redis.

    Args:
        url: a ``redis://`` URL, or ``redis+cluster://HOST:PORT,HOST:PORT,...`` for a Redis
            Cluster (a session's keys share one slot, through their hash tag).
        prefix: key prefix (several apps may share one Redis).
        tombstone_s: how long after expiry a read still says "expired" rather than "absent".
        durability: the replicas each state write waits for, and what a Redis without an
            fsynced append-only file gets at start-up (default: no wait, a warning).

    Raises:
        BackendUnavailableError: Redis does not answer.
        ConfigError: a non-durable Redis under ``durability.policy="require"``.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "keel:state",
        tombstone_s: float = 3600,
        durability: RedisDurability | None = None,
    ) -> None:
        self._redis = _RedisScripts(url, durability)
        self._client = self._redis.client
        self.url = url
        self.prefix = prefix
        self.tombstone_ms = int(tombstone_s * 1000)
        self._sessions_key = f"{prefix}:sessions"

    def _keys(self, session_id: str) -> list[str]:
        tag = f"{self.prefix}:{{{session_id}}}"
        return [f"{tag}:head", f"{tag}:rows", f"{tag}:fulls", f"{tag}:tomb"]

    def _lock_key(self, key: str) -> list[str]:
        return [f"{self.prefix}:lock:{key}"]

    # Each operation is written once, as the async method over _RedisScripts.script: awaited,
    # it runs on this loop's async client; its sync twin runs the same code inline on the sync
    # client (keel.state._twins).

    async def aread_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        args = ["" if version is None else version, repr(now)]
        found = await self._redis.script("read", self._keys(session_id), args)
        return _chain_from(session_id, found, now)

    async def aread_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        args = ["", repr(now), known_version, known_epoch]
        found = await self._redis.script("read", self._keys(session_id), args)
        return _chain_from(session_id, found, now)

    async def awrite(
        self,
        session_id: str,
        row: StoredCheckpoint,
        *,
        expected_version: int | None,
        expected_epoch: str | None,
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> None:
        args = [
            "create" if expected_version is None else "append",
            "" if expected_version is None else expected_version,
            expected_epoch or "",
            new_epoch or "",
            row.version,
            _meta(row),
            row.kind,
            "" if ttl is None else repr(float(ttl)),
            repr(now),
            self.tombstone_ms,
            row.payload,
            _flag(row.good),
        ]
        result = await self._redis.script("write", self._keys(session_id), args)
        _check_write(session_id, expected_version, result)
        if expected_version is None:
            await self._redis.script("sadd", [self._sessions_key], [session_id])

    async def ahistory(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        found = await self._redis.script("history", self._keys(session_id), [repr(now)])
        return _history_from(session_id, found, now)

    async def amark(self, session_id: str, version: int, good: bool | None) -> bool:
        keys = self._keys(session_id)[1:2]
        return bool(await self._redis.script("mark", keys, [version, _flag(good)]))

    async def adelete(self, session_id: str) -> bool:
        if self._redis.cluster:
            # The index of sessions lives on another slot: no script may touch both.
            existed = await self._redis.script("delete", self._keys(session_id), [session_id])
            await self._redis.script("srem", [self._sessions_key], [session_id])
            return bool(existed)
        keys = [*self._keys(session_id), self._sessions_key]
        return bool(await self._redis.script("delete", keys, [session_id]))

    async def aacquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        args = [owner, max(1, int(ttl * 1000))]
        return bool(await self._redis.script("acquire", self._lock_key(key), args))

    async def arelease_lock(self, key: str, owner: str) -> bool:
        return bool(await self._redis.script("release", self._lock_key(key), [owner]))

    read_chain = sync_twin(aread_chain)
    read_head_chain = sync_twin(aread_head_chain)
    write = sync_twin(awrite)
    history = sync_twin(ahistory)
    mark = sync_twin(amark)
    delete = sync_twin(adelete)
    acquire_lock = sync_twin(aacquire_lock)
    release_lock = sync_twin(arelease_lock)

    def lock_holder(self, key: str, now: float) -> str | None:
        value = self._redis.run(self._client.get, self._lock_key(key)[0])
        return None if value is None else _text(value)

    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        args: list[Any] = [len(replace)]
        for row in replace:
            args.extend([row.version, row.payload, _meta(row)])
        args.extend(delete)
        self._redis.call("rewrite", self._keys(session_id)[:3], args)

    def sessions(self) -> list[str]:
        members = self._redis.run(self._client.smembers, self._sessions_key)
        return sorted(_text(member) for member in members)

    def purge_expired(self, now: float) -> list[str]:
        expired: list[str] = []
        for session_id in self.sessions():
            head = self._keys(session_id)[0]
            values = self._redis.run(self._client.hmget, head, ["version", "expires_at"])
            if values[0] is not None:
                expires_at = values[1]
                if expires_at is None or float(_text(expires_at)) > now:
                    continue
            # Gone (native TTL) or past its expiry: drop it and its index entry.
            self._redis.run(self._client.delete, *self._keys(session_id))
            self._redis.run(self._client.srem, self._sessions_key, session_id)
            expired.append(session_id)
        return expired

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Each session's keys (head, rows, fulls, tombstone), its lease and its index entry,
        deleted in one round trip per session (idempotent: a rerun deletes what is left); its
        checkpoints counted from its rows' metadata fields first."""
        counts = {"sessions": 0, "checkpoints": 0, "leases": 0}
        for session_id in dict.fromkeys(session_ids):
            head, rows, fulls, tomb = self._keys(session_id)
            fields = self._redis.run(self._client.hkeys, rows)
            pipe = self._client.pipeline(transaction=False)
            for key in (head, rows, fulls, tomb):  # one key a DEL: a cluster's pipeline wants so
                pipe.delete(key)
            pipe.delete(self._lock_key(LEASE_KEY_PREFIX + session_id)[0])
            pipe.srem(self._sessions_key, session_id)
            *removed, leases, indexed = self._redis.run(pipe.execute)
            removed_keys = sum(int(count) for count in removed)
            counts["checkpoints"] += sum(1 for name in fields if _text(name).startswith("m:"))
            counts["sessions"] += int(bool(removed_keys or indexed))
            counts["leases"] += int(leases)
        return counts

    def storage_bytes(self) -> int:
        total = 0
        for key in self._client.scan_iter(match=f"{self.prefix}:*", count=1000):
            total += int(self._redis.run(self._client.memory_usage, key, 0) or 0)
        return total

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        await self._redis.aclose()
