"""Redis clients from one URL: a single server (``redis://``, ``rediss://``, ``unix://``) or a
Redis Cluster (``redis+cluster://HOST:PORT,HOST:PORT,...``, ``rediss+cluster://`` with TLS),
through redis-py's cluster-aware client, which follows the cluster's slot map (``MOVED`` and
``ASK`` redirections, a failover's new primary).

And what keel requires of a Redis that holds its state, checked when the state backend opens
([`durability_problems`][keel.stores._redis_client.durability_problems]): an append-only file
fsynced on every write on every primary, and as many replicas as each state write waits for
(``WAIT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from keel.errors import ConfigError

__all__ = [
    "CLUSTER_SCHEMES",
    "RedisDurability",
    "async_redis_client",
    "durability_problems",
    "is_cluster_url",
    "redis_client",
]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""The schemes of a Redis Cluster URL: every start-up node, comma-separated, after ``//``."""

DurabilityPolicy = Literal["warn", "require", "off"]


@dataclass(frozen=True)
class RedisDurability:
    """What a Redis state backend asks of its Redis.

    Attributes:
        wait_replicas: replicas each state write waits for (``WAIT``) before it is
            acknowledged; 0 acknowledges once the primary has it (a failover may lose the
            writes of the last moments before it, the replication lag).
        wait_timeout_ms: how long a write waits for them; fewer by then fail the write with
            [`BackendUnavailableError`][keel.errors.BackendUnavailableError] (it is on the
            primary, not acknowledged).
        policy: what a non-durable Redis gets at start-up: ``warn`` (a log line), ``require``
            (refused: [`ConfigError`][keel.errors.ConfigError]) or ``off`` (not checked).
    """

    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    policy: DurabilityPolicy = "warn"


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def _cluster_options(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The start-up nodes and connection options of a ``redis+cluster://`` URL.

    Raises:
        ConfigError: no node, a node without a port, or a database other than 0 (a cluster
            has only database 0).
    """
    scheme, _, rest = url.partition("://")
    where, _, path = rest.partition("/")
    credentials, _, hosts = where.rpartition("@")
    options: dict[str, Any] = {}
    if credentials:
        user, _, password = credentials.partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    if scheme.lower().startswith("rediss"):
        options["ssl"] = True
    database = path.partition("?")[0]
    if database not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has only database 0 (the URL names {database!r})")
    nodes: list[tuple[str, int]] = []
    for node in filter(None, hosts.split(",")):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"a Redis Cluster node is HOST:PORT (got {node!r} in {scheme}://)")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ConfigError(f"{scheme}:// names no node: use {scheme}://HOST:PORT,HOST:PORT")
    return nodes, options


def redis_client(url: str, **options: Any) -> Any:
    """A sync redis-py client for ``url``: a ``RedisCluster`` for a cluster URL, else a
    ``Redis``; ``options`` go to either (``socket_timeout``, ...)."""
    if not is_cluster_url(url):
        import redis

        return redis.Redis.from_url(url, **options)
    from redis import cluster

    nodes, given = _cluster_options(url)
    options.pop("health_check_interval", None)
    node: Any = cluster.ClusterNode  # redis-py leaves its __init__ untyped
    return cluster.RedisCluster(
        startup_nodes=[node(host, port) for host, port in nodes], **given, **options
    )


def async_redis_client(url: str, **options: Any) -> Any:
    """The redis.asyncio twin of [`redis_client`][keel.stores._redis_client.redis_client]
    (one client per event loop)."""
    if not is_cluster_url(url):
        from redis import asyncio as aredis

        return aredis.Redis.from_url(url, **options)
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    nodes, given = _cluster_options(url)
    options.pop("health_check_interval", None)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes], **given, **options
    )


def _primaries(client: Any) -> list[tuple[str, Any]]:
    """Each primary's address and a plain client for it."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        cluster: Any = client
        return [(node.name, cluster.get_redis_connection(node)) for node in cluster.get_primaries()]
    kwargs = client.connection_pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
    return [(str(where), client)]


def durability_problems(client: Any, wait_replicas: int) -> list[str]:
    """What keeps the Redis behind ``client`` from keeping every acknowledged state write: per
    primary, no append-only file, one not fsynced on every write (``appendfsync always``),
    fewer connected replicas than ``wait_replicas``, or settings it does not let keel read
    (``CONFIG GET`` disabled, as some managed services do). Empty when durable."""
    import redis

    problems: list[str] = []
    for where, node in _primaries(client):
        try:
            config = node.config_get("append*")
            replicas = int(node.info("replication").get("connected_slaves", 0))
        except redis.ResponseError as exc:
            problems.append(f"{where}: its persistence settings cannot be read ({exc})")
            continue
        config = {_text(k): _text(v) for k, v in config.items()}
        if config.get("appendonly") != "yes":
            problems.append(f"{where}: appendonly is {config.get('appendonly')!r}, not 'yes'")
        elif config.get("appendfsync") != "always":
            problems.append(
                f"{where}: appendfsync is {config.get('appendfsync')!r}, not 'always' (up to "
                "a second of acknowledged writes is lost in a crash)"
            )
        if replicas < wait_replicas:
            problems.append(
                f"{where}: {replicas} connected replicas, fewer than the {wait_replicas} each "
                "state write waits for (KEEL_REDIS_WAIT_REPLICAS)"
            )
    return problems


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
