"""``keel.service.mount``: keel inside an application's own FastAPI app, over real HTTP,
driven by the ``openai`` SDK; the application's routes still answer."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
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
