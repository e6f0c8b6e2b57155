"""What ``keel serve`` says on stderr as it starts and stops, as an operator reads it.

A Redis that can lose acknowledged state writes is one warning line: it was two per worker
when the served agent's factory opened its own stores (the factory's, then the service's), and
none with one worker, whose start-up logged to the data directory's keel.log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service.conftest import keel_serve

ROOT = Path(__file__).resolve().parents[2]
FACTORY = '''
from keel import Agent


def build(settings=None):
    return Agent.open(settings, model="scripted:echo", system_prompt="You help.", memory=False)
'''
NOT_DURABLE = "can lose acknowledged state writes"


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    (tmp_path / "served_agent.py").write_text(FACTORY)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)]),
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_REDIS_URL": redis_url,  # the tests' Redis: no append-only file
    }


def test_a_redis_that_can_lose_writes_is_one_warning_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    with keel_serve(
        "--agent", "served_agent:build", "--no-memory", env=env, cwd=tmp_path, until_said=True
    ) as served:
        pass
    warned = [line for line in served.stderr.splitlines() if NOT_DURABLE in line]
    assert len(warned) == 1, served.stderr
    assert "WARNING keel.stores Redis at redis://" in warned[0]
