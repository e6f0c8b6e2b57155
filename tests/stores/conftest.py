"""The production topologies the store tests also run on: PgBouncer (transaction pooling) in
front of the session's PostgreSQL, and a Redis Cluster (three primaries, three replicas)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from keel.testing.servers import PostgresTestServer
from keel.testing.topologies import PgBouncer, RedisTestCluster, pgbouncer, redis_cluster


@pytest.fixture(scope="session")
def pgbouncer_server(postgres_test_server: PostgresTestServer) -> Iterator[PgBouncer]:
    """One PgBouncer in transaction pooling mode in front of the session's PostgreSQL."""
    with pgbouncer(postgres_test_server) as bouncer:
        yield bouncer


@pytest.fixture
def pgbouncer_url(postgres_url: str, pgbouncer_server: PgBouncer) -> str:
    """A fresh, empty PostgreSQL database for one test, reached through PgBouncer."""
    return pgbouncer_server.url(postgres_url)


@pytest.fixture(scope="session")
def redis_test_cluster() -> Iterator[RedisTestCluster]:
    """One Redis Cluster (3 primaries, 3 replicas, no persistence) for the whole session."""
    with redis_cluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_test_cluster: RedisTestCluster) -> str:
    """The session's Redis Cluster, every primary emptied before each test."""
    from redis.cluster import ClusterNode, RedisCluster

    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in redis_test_cluster.nodes]
    )
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    client.close()
    return redis_test_cluster.url
