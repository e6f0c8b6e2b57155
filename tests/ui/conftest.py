"""What the viewer's tests share: a real headless Chromium (Debian's ``chromium``, driven by
Playwright through its executable path), one database a real ``keel demo`` filled, served by
``keel serve`` (both once per test session), and the service on uvicorn as two workers on one
database, its key store's clock injected."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from keel.service import APIKeys, ServiceAgents, create_app
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from keel.tracing import TraceStore
from tests.service.conftest import create_key, keel_serve, serving


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("chromium is not installed: ./setup.sh installs Debian's package")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One browser per test module: Playwright's sync API runs an event loop on this thread
    while it is open, which later tests' own loops must not find running."""
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=_chromium(), headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


@dataclass
class Clock:
    """The key store's clock: seconds since the epoch, moved on by the test."""

    now: float = field(default_factory=time.time)

    def __call__(self) -> float:
        return self.now


@dataclass
class Served:
    """The service as two workers: each with its own stores and keys, on one database."""

    urls: tuple[str, str]
    keys: APIKeys
    clock: Clock
    database: Path
    traces: TraceStore


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    database = tmp_path / "keel.db"
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    clock = Clock()
    opened: list[Backends] = []
    apps = []
    for _ in range(2):
        backends = Backends.open(f"sqlite:///{database}", memory=False, settings=settings)
        opened.append(backends)
        agents = ServiceAgents(
            backends, ScriptedModel(lambda call: "Noted."), system_prompt="You take notes."
        )
        apps.append(create_app(agents, APIKeys(backends.sql, clock=clock), backends.traces))
    try:
        with serving(apps[0]) as first, serving(apps[1]) as second:
            keys = APIKeys(opened[0].sql, clock=clock)
            yield Served((first.url, second.url), keys, clock, database, opened[0].traces)
    finally:
        for backends in opened:
            backends.close()


@dataclass
class DemoViewer:
    """``keel serve`` on a database a real ``keel demo`` run filled: its url, a key of the
    demo's tenant and one of another tenant."""

    url: str
    key: str
    other_key: str
    shots: Path
    env: dict[str, str]


@pytest.fixture(scope="session")
def demo_viewer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoViewer]:
    """One demo database and one server for every page test (the demo takes seconds)."""
    work = tmp_path_factory.mktemp("ui")
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(work / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": f"sqlite:///{work / 'demo' / 'keel.db'}",
    }
    demo = subprocess.run(
        [
            *(sys.executable, "-m", "keel", "demo", "--trips", "2", "--side-questions", "1"),
            *("--workdir", str(work / "demo"), "--json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert json.loads(demo.stdout.strip().splitlines()[-1])["passed"]
    key, other = create_key("default", env), create_key("other", env)
    with keel_serve("--model", "scripted:echo", env=env) as served:
        yield DemoViewer(served.url, key, other, work / "screenshots", env)
