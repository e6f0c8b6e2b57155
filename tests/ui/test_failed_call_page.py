"""A model call that failed shows on the run page as it happened (issue 49): how long it took
before it failed, the prompt it was sent, its error and that it gave no answer; not
``0 ms · 0 + 0 tokens``. A real Agent on SQLite, then the viewer over real HTTP."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from keel.errors import ModelUnavailableError
from keel.runtime import Agent
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.ui import COOKIE
from tests.service.conftest import serving

_DELAY_S = 0.25


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+) (ms|s)", text.strip()).groups()  # type: ignore[union-attr]
    return float(value) * (1000 if unit == "s" else 1)


def test_a_failed_model_call_shows_its_time_its_prompt_and_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = load_settings(data_dir=tmp_path)
    model = ScriptedModel([ModelUnavailableError("the model server went away"), "On its way."])
    model.delay_s = _DELAY_S
    agent = Agent.open(
        database, settings=settings, model=model, memory=False, system_prompt="You help."
    )
    try:
        reply = agent.handle_sync("s1", "u1", "Where is my order 1024?")
    finally:
        agent.close()
    assert reply.status == "completed"
    app, agents, keys = build_service(database, memory=False, settings=settings)
    try:
        with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
            client.post("/ui/login", data={"key": keys.create("default")})
            assert COOKIE in client.cookies
            page = client.get(f"/ui/runs/{reply.run_id}")
    finally:
        agents.backends.close()
    assert page.status_code == 200
    failed = re.search(
        r'<li class="step kind-model failed".*?<summary>(.*?)</summary>', page.text, re.DOTALL
    )
    assert failed is not None, "the failed call is a failed step"
    summary = re.sub(r"<[^>]+>", " ", failed.group(1))
    took = re.search(r"failed after ([\d.]+ m?s)", summary)
    assert took is not None and _ms(took.group(1)) >= _DELAY_S * 1000 * 0.9, summary
    tokens = re.search(r"([\d,]+) \+ (\d+) tokens", summary)
    assert tokens is not None and int(tokens.group(1).replace(",", "")) > 10, summary
    assert "no answer" in summary and "ModelUnavailableError" in summary
