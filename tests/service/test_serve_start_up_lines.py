"""What ``keel serve`` says on stderr as it starts and stops, as an operator reads it.

A Redis that can lose acknowledged state writes is one warning line: it was two per worker
when the served agent's factory opened its own stores (the factory's, then the service's), and
none with one worker, whose start-up logged to the data directory's keel.log. A factory that
returns something else than an Agent is named in plain English ("a value of type int"). A
worker that fails at start-up is one error line and exit 2; a worker gone while a SIGTERM to
the whole process group (systemd's stop) is pending is part of the stop: no error line, exit
0, as a stop of a started service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from uvicorn.supervisors.multiprocess import Multiprocess

from keel.service._drain import DrainingMultiprocess
from tests.service.conftest import keel_serve

ROOT = Path(__file__).resolve().parents[2]
FACTORY = """
import os

from keel import Agent

IN_A_WORKER = "KEEL_SERVE_OPTIONS" in os.environ  # not keel serve's own check of the factory


def build(settings=None):
    return Agent.open(settings, model="scripted:echo", system_prompt="You help.", memory=False)


def wrong(settings=None):
    return 42


def failing_worker(settings=None):
    if IN_A_WORKER:
        raise RuntimeError("this worker cannot start")
    return build(settings)

"""
NOT_DURABLE = "can lose acknowledged state writes"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "served_agent.py").write_text(FACTORY)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)]),
        "KEEL_DATA_DIR": str(tmp_path / "data"),
    }


def test_a_redis_that_can_lose_writes_is_one_warning_line(
    env: dict[str, str], tmp_path: Path, redis_url: str
) -> None:
    env["KEEL_REDIS_URL"] = redis_url  # the tests' Redis: no append-only file
    with keel_serve(
        "--agent", "served_agent:build", "--no-memory", env=env, cwd=tmp_path, until_said=True
    ) as served:
        pass
    warned = [line for line in served.stderr.splitlines() if NOT_DURABLE in line]
    assert len(warned) == 1, served.stderr
    assert "WARNING keel.stores Redis at redis://" in warned[0]


def _serve(env: dict[str, str], cwd: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``keel serve ARGUMENTS`` that stops on its own (it fails to start)."""
    return subprocess.run(
        [sys.executable, "-m", "keel", "serve", "--port", "0", "--no-memory", *arguments],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_factory_that_returns_no_agent_is_named_in_plain_english(
    env: dict[str, str], tmp_path: Path
) -> None:
    failed = _serve(env, tmp_path, "--agent", "served_agent:wrong")
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.strip().splitlines() == [
        "error: --agent 'served_agent:wrong': the factory returned a value of type int, not an "
        "Agent"
    ], failed.stderr


def test_a_worker_that_fails_at_start_up_is_one_error_line_and_exit_2(
    env: dict[str, str], tmp_path: Path
) -> None:
    failed = _serve(env, tmp_path, "--agent", "served_agent:failing_worker", "--workers", "2")
    assert failed.returncode == 2, failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, failed.stderr
    assert errors[0].startswith("error: a worker stopped before it was ready (exit code ")
    assert "this worker cannot start" in failed.stderr  # the worker's own error, logged
    assert "listening on" not in failed.stdout


class _StoppedWorker:
    """A worker process that is gone (its exit code ``exitcode``)."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode
        self.process = self

    def is_alive(self) -> bool:
        return False

    def join(self) -> None:
        pass


@pytest.mark.parametrize(
    ("signalled", "failed"), [([signal.SIGTERM], None), ([], 1)], ids=["stopped", "failed"]
)
def test_a_worker_gone_while_a_stop_is_pending_is_a_stop_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, signalled: list[int], failed: int | None
) -> None:
    # The supervisor's seam, without processes: the workers died of the group's SIGTERM before
    # the supervisor read its own (a run of keel serve leaves that order to the kernel).
    monkeypatch.setattr(Multiprocess, "init_processes", lambda self: None)
    supervisor = DrainingMultiprocess.__new__(DrainingMultiprocess)
    supervisor.processes = [_StoppedWorker(-signal.SIGTERM if signalled else 1)]
    supervisor.signal_queue = list(signalled)
    supervisor.should_exit = threading.Event()
    supervisor.on_ready = None
    supervisor.failed_exit_code = None
    supervisor.init_processes()
    assert supervisor.should_exit.is_set()
    assert supervisor.failed_exit_code == failed


def test_workers_are_spawned_with_ctrl_c_ignored_until_their_server_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A spawned process keeps an ignored signal ignored: a worker still importing keel when
    # Ctrl-C reaches the terminal's group printed a KeyboardInterrupt traceback.
    at_spawn: list[object] = []
    monkeypatch.setattr(
        Multiprocess,
        "init_processes",
        lambda self: at_spawn.append(signal.getsignal(signal.SIGINT)),
    )
    supervisor = DrainingMultiprocess.__new__(DrainingMultiprocess)
    supervisor.processes = []
    supervisor.should_exit = threading.Event()
    supervisor.on_ready = None
    before = signal.getsignal(signal.SIGINT)
    supervisor.init_processes()
    assert at_spawn == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is before  # the supervisor's own, back
