"""The state conformance suite on PostgreSQL (a throwaway database per test)."""

from __future__ import annotations

import pytest

from keel.testing.state_conformance import StateBackendConformance

pytestmark = pytest.mark.postgres


class TestSQLStateBackendOnPostgres(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, postgres_url: str) -> str:
        return postgres_url
