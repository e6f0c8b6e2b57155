"""Shared fixtures: every test runs with its own data directory and no config file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


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
