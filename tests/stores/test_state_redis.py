"""The state conformance suite on Redis (flushed per test)."""

from __future__ import annotations

import pytest

from keel.testing.state_conformance import StateBackendConformance

pytestmark = pytest.mark.redis


class TestRedisStateBackend(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, redis_url: str) -> str:
        return redis_url
