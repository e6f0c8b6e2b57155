"""What the viewer's tests share: a real headless Chromium (Debian's ``chromium``, driven by
Playwright through its executable path), and the service on uvicorn as two workers on one
database, its key store's clock injected."""

from __future__ import annotations

import shutil
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
from tests.service.conftest import serving


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("chromium is not installed: ./setup.sh installs Debian's package")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
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
