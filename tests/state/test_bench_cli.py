"""``keel bench state`` as a user runs it (a small workload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_state_json_contract() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "bench",
            "state",
            "--steps",
            "30",
            "--writers",
            "4",
            "--increments",
            "2",
            "--backend",
            "sqlite",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    sqlite = figures["backends"]["sqlite"]
    assert sqlite["lost_updates"] == 0 and sqlite["checkpoints_per_s"] > 0
    assert sqlite["bytes_total"] > 0 and sqlite["read_ms_p50"] > 0
    lang = figures["langgraph_sqlite"]
    assert lang["checkpoints_per_s"] > 0 and lang["bytes_total"] > 0


def test_bench_state_rejects_unknown_backend() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "state", "--backend", "mongo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert result.returncode == 2 and "unknown backend" in result.stderr


def test_bench_refuses_a_database_with_keel_state(postgres_url: str) -> None:
    import pytest

    from keel.bench.state import run_state_bench
    from keel.errors import UsageError
    from keel.state import StateStore
    from keel.testing._state_models import CounterState
    from keel.testing._state_worker import state_backend_at

    store = StateStore(state_backend_at(postgres_url), CounterState)
    store.create("real-user-session", CounterState(counter=7))
    with pytest.raises(UsageError, match="already holds keel state"):
        run_state_bench(steps=5, backends=("postgres",), postgres_url=postgres_url, langgraph=False)
    assert store.load("real-user-session").state.counter == 7
    store.close()


def test_bench_on_a_configured_empty_database_cleans_up(postgres_url: str) -> None:
    from keel.bench.state import run_state_bench
    from keel.testing._state_worker import state_backend_at

    figures = run_state_bench(
        steps=10,
        writers=2,
        increments=2,
        backends=("postgres",),
        postgres_url=postgres_url,
        langgraph=False,
    )
    assert figures["backends"]["postgres"]["lost_updates"] == 0
    backend = state_backend_at(postgres_url)
    assert backend.sessions() == []
    backend.close()


def test_state_operations_cli(tmp_path: Path) -> None:
    from keel.state import StateStore
    from keel.testing._state_models import CounterState
    from keel.testing._state_worker import state_backend_at

    url = f"sqlite:///{tmp_path / 'ops.db'}"
    store = StateStore(state_backend_at(url), CounterState, snapshot_every=3)
    cp = store.create("a", CounterState())
    for _ in range(6):
        cp = store.update("a", {"counter": 1}, expected_version=cp.version)
    store.mark("a", 3, good=True)
    store.close()

    def keel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "keel", *args, "--url", url],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )

    assert json.loads(keel("state", "sessions", "--json").stdout) == {"sessions": ["a"]}
    history = json.loads(keel("state", "history", "a", "--json").stdout)
    assert [c["version"] for c in history["checkpoints"]] == [7, 6, 5, 4, 3, 2, 1]
    report = json.loads(keel("state", "vacuum", "--keep-last", "2", "--json").stdout)
    assert report["checkpoints_deleted"] == 4
    history = json.loads(keel("state", "history", "a", "--json").stdout)
    assert [c["version"] for c in history["checkpoints"]] == [7, 6, 3]
    missing = keel("state", "history", "nobody")
    assert missing.returncode == 1 and "no state stored" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = keel("state", "vacuum", "--keep-last", "0")
    assert bad.returncode == 2
    reopened = StateStore(state_backend_at(url), CounterState)
    assert reopened.load("a").state.counter == 6 and reopened.at("a", 3).state.counter == 2
    reopened.close()
