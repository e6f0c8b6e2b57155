"""Invalid configuration is one typed ConfigError (API) and one error line, exit 2 (CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.errors import ConfigError
from keel.settings import MAX_BUSY_TIMEOUT_MS, load_settings


def _keel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def _one_error_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _latin1_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes('model = "scripted:caf\xe9"\n'.encode("latin-1"))
    return path


def test_a_config_file_that_is_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _latin1_config(tmp_path / "latin1.toml")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(bad)
    _one_error_line(_keel("runs", "list", env={"KEEL_CONFIG": str(bad)}), "not UTF-8")
    # The default location too (found without KEEL_CONFIG), which every command reads.
    default = _latin1_config(Path(os.environ["XDG_CONFIG_HOME"]) / "keel" / "keel.toml")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings()
    _one_error_line(_keel("runs", "list", env={}), "not UTF-8", str(default))


@pytest.mark.parametrize("url", ["garbage://x", "mysql://db/keel", "keel.db", "sqlite:///", " "])
def test_an_unsupported_database_url(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_DATABASE", url)
    with pytest.raises(ConfigError, match="database"):
        load_settings()
    if url == "garbage://x":
        _one_error_line(_keel("runs", "list", env={}), "garbage://")


def test_supported_database_urls_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("sqlite:///tmp/k.db", "postgresql://u@h/db", "postgres://h/db"):
        monkeypatch.setenv("KEEL_DATABASE", url)
        assert load_settings().database_url == url


def test_an_absurd_busy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_BUSY_TIMEOUT_MS", "99999999999999999999999")
    with pytest.raises(ConfigError, match="busy_timeout_ms"):
        load_settings()
    _one_error_line(_keel("runs", "list", env={}), "busy_timeout_ms")
    monkeypatch.setenv("KEEL_BUSY_TIMEOUT_MS", str(MAX_BUSY_TIMEOUT_MS))
    assert load_settings().busy_timeout_ms == MAX_BUSY_TIMEOUT_MS
    monkeypatch.setenv("KEEL_BUSY_TIMEOUT_MS", "-1")
    with pytest.raises(ConfigError):
        load_settings()
