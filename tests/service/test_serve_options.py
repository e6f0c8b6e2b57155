"""``keel serve``'s options: one typed model, validated in the command and again in each
worker process, which receives it as JSON (its metrics token included, never in ``ps``)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from keel.errors import ConfigError
from keel.service import ServeOptions
from tests.service.conftest import keel_serve


def test_the_options_come_back_from_their_json_with_the_token_and_keep_it_out_of_repr() -> None:
    options = ServeOptions(
        database="sqlite:///keel.db",
        model="scripted:echo",
        memory=False,
        metrics_token="a-metrics-secret-7f3a",  # type: ignore[arg-type]
        rate_limit_per_minute=120,
    )
    again = ServeOptions.from_json(options.to_json())
    assert again == options
    assert again.metrics_token is not None
    assert again.metrics_token.get_secret_value() == "a-metrics-secret-7f3a"
    assert "a-metrics-secret-7f3a" not in repr(options)


@pytest.mark.parametrize(
    ("text", "field"),
    [('{"databse": "sqlite:///k.db"}', "databse"), ('{"body_timeout_s": 0}', "body_timeout_s")],
)
def test_options_a_worker_cannot_use_are_a_config_error_naming_the_field(
    text: str, field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        ServeOptions.from_json(text)


def test_two_workers_get_the_metrics_token_from_the_options(tmp_path: Path) -> None:
    token = "a-metrics-secret-7f3a"
    token_file = tmp_path / "metrics-token"
    token_file.write_text(token + "\n")
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }
    env.pop("KEEL_METRICS_TOKEN", None)
    arguments = ("--workers", "2", "--model", "scripted:echo", "--no-memory")
    with keel_serve(*arguments, "--metrics-token-file", str(token_file), env=env) as served:
        metrics = httpx.get(
            f"{served.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        assert metrics.status_code == 200, metrics.text
