"""``keel.service.mount``: keel inside an application's own FastAPI app, over real HTTP,
driven by the ``openai`` SDK; the application's routes still answer."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from keel.runtime import Agent
from keel.service import mount
from keel.settings import Settings, load_settings
from keel.testing import ScriptedModel
from tests.service.conftest import serving


def test_a_mounted_agent_answers_under_its_path_beside_the_apps_routes(tmp_path: Path) -> None:
    tenants: list[str] = []

    def build(settings: Settings) -> Agent:
        tenants.append(str(settings.data_dir))
        model = ScriptedModel(lambda call: f"shop: {call.last_user_text}")
        return Agent.open(settings, model=model, system_prompt="You help.", memory=False)

    app = FastAPI()

    @app.get("/hello")
    def hello() -> dict[str, str]:
        return {"hello": "world"}

    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    keys = mount(app, build, path="/support", database=settings, memory=False)
    ada, bob = keys.create("acme", user_id="ada"), keys.create("globex", user_id="bob")
    with serving(app) as running:
        assert httpx.get(f"{running.url}/hello", timeout=10).json() == {"hello": "world"}
        for key in (ada, bob):
            client = openai.OpenAI(base_url=f"{running.url}/support/v1", api_key=key, max_retries=0)
            reply = client.chat.completions.create(
                model="keel", messages=[{"role": "user", "content": "where is 1024?"}]
            )
            assert reply.choices[0].message.content == "shop: where is 1024?"
        refused = httpx.get(f"{running.url}/support/v1/models", timeout=10)
        assert refused.status_code == 401
    # The factory built the check's agent and one per tenant on the given settings.
    assert tenants == [str(tmp_path)] * 2


@pytest.mark.parametrize("form", ["agent", "factory()", "factory(settings)"])
def test_mount_takes_an_agent_or_either_factory_each_tenant_scoped(
    tmp_path: Path, form: str
) -> None:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")

    def made() -> Agent:
        model = ScriptedModel(lambda call: f"{form}: {call.last_user_text}")
        return Agent.embedded(model, system_prompt="You help.", memory=False, settings=settings)

    target: Any = {
        "agent": made(),
        "factory()": made,
        "factory(settings)": lambda settings: made(),
    }[form]
    app = FastAPI()
    keys = mount(app, target, database=settings, memory=False)
    ada, bob = keys.create("acme", user_id="ada"), keys.create("globex", user_id="bob")
    with serving(app) as running:
        for key in (ada, bob):
            with httpx.Client(base_url=f"{running.url}/keel", timeout=30) as client:
                reply = client.post(
                    "/v1/sessions/s1/turns",
                    json={"message": "hi", "user": "ada" if key == ada else "bob"},
                    headers={"Authorization": f"Bearer {key}"},
                )
            assert reply.status_code == 200, reply.text
            assert reply.json()["text"] == f"{form}: hi"
    # The same session id in two tenants: two sessions, each in its tenant's store.
    with sqlite3.connect(tmp_path / "keel.db") as db:
        stored = {row[0] for row in db.execute("SELECT session_id FROM keel_state_sessions")}
    assert stored == {"acme/s1", "globex/s1"}
