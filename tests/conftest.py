"""Shared fixtures: every test runs with its own data directory and no config file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from keel.testing.servers import PostgresTestServer, postgres_server, redis_server

# Hypothesis: the same examples on every CI run (a failure is a real failure, reproducible from
# the printed blob), no deadline (a loaded runner is not a bug). Locally the search stays random
# so it keeps finding new cases; HYPOTHESIS_PROFILE=ci reproduces CI.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture(autouse=True)
def _isolated_keel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point keel at a throwaway data directory and away from the user's config and keys."""
    for name in list(os.environ):
        if name.startswith(("KEEL_", "OPENAI_")):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KEEL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield


@pytest.fixture(scope="session")
def postgres_test_server() -> Iterator[PostgresTestServer]:
    """One real PostgreSQL 18 + pgvector server for the whole test session."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_test_server: PostgresTestServer) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    with postgres_test_server.throwaway_database() as url:
        yield url


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """One real redis-server for the whole test session."""
    with redis_server() as url:
        yield url


@pytest.fixture
def redis_url(redis_server_url: str) -> Iterator[str]:
    """The session's Redis, emptied before each test."""
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    client.close()
    yield redis_server_url


def pytest_sessionstart(session: pytest.Session) -> None:
    """Print the random order's seed even under ``-q`` (CI runs quiet): a failure that depends
    on the order is replayed with ``pytest -p randomly --randomly-seed=N``."""
    seed = getattr(session.config.option, "randomly_seed", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:
        reporter.write_line(f"random test order, seed {seed} (--randomly-seed={seed} replays it)")
