from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import ConfigError
from keel.settings import load_settings


def test_defaults_put_the_database_in_the_data_dir(tmp_path: Path) -> None:
    settings = load_settings()
    assert settings.data_dir == tmp_path / "data"
    assert settings.sqlite_path == tmp_path / "data" / "keel.db"
    assert settings.database_url == f"sqlite:///{tmp_path / 'data' / 'keel.db'}"


def test_config_file_then_env_then_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "keel.toml"
    config.write_text('[keel]\nmodel = "openai:gpt-4o"\nbusy_timeout_ms = 100\n')
    monkeypatch.setenv("KEEL_CONFIG", str(config))
    assert load_settings().model == "openai:gpt-4o"
    monkeypatch.setenv("KEEL_MODEL", "openai:gpt-4o-mini")
    settings = load_settings()
    assert settings.model == "openai:gpt-4o-mini"  # env beats the file
    assert settings.busy_timeout_ms == 100  # the file still supplies the rest
    assert load_settings(model="local:smollm2").model == "local:smollm2"  # arguments beat env


def test_invalid_value_is_one_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_BUSY_TIMEOUT_MS", "-5")
    with pytest.raises(ConfigError, match="busy_timeout_ms"):
        load_settings()


def test_unknown_key_in_file_is_rejected(tmp_path: Path) -> None:
    config = tmp_path / "keel.toml"
    config.write_text('modle = "typo"\n')
    with pytest.raises(ConfigError, match="modle"):
        load_settings(config)


def test_malformed_and_missing_config_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("model = [unclosed\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(broken)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "absent.toml")


def test_api_key_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_OPENAI_API_KEY", "sk-test-123456")
    settings = load_settings()
    assert settings.openai_api_key is not None
    assert "sk-test" not in repr(settings)
    assert settings.openai_api_key.get_secret_value() == "sk-test-123456"
