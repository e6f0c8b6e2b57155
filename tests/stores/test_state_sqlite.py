"""The state conformance suite on the embedded SQLite backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.testing.state_conformance import StateBackendConformance


class TestSQLStateBackendOnSQLite(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, tmp_path: Path) -> str:
        return f"sqlite:///{tmp_path / 'state.db'}"
