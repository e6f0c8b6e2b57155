"""The service the OpenAI facade tests talk to with the ``openai`` SDK: uvicorn on a loopback
port, a scripted model whose answer depends on the user's words: ``fail ...`` (the model
fails on every call), ``cut ...`` (every answer stops at the token limit), ``look ...`` (the
model says a few words, calls a tool, then fails), ``pay ...`` (a payment whose outcome is in
doubt: the turn is parked for an operator), anything else a normal answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from keel.errors import ModelError
from keel.guards import GuardConfig
from keel.messages import Message, Usage
from keel.models import Completion
from keel.service import APIKeys, ServiceAgents, create_app
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.service.conftest import serving

CUT = "Once upon a time"


def users_words(call: ScriptedCall) -> str:
    """The user's message of the turn (not the runtime's corrections after it)."""
    said = [m for m in call.messages if m.role == "user" and "keel_correction" not in m.metadata]
    return said[-1].content if said else ""


def _answer(call: ScriptedCall) -> str | Message | Completion | BaseException:
    words = users_words(call)
    if words.startswith("fail"):
        return ModelError("the provider is down", model="scripted")
    if words.startswith("cut"):
        return Completion(
            message=Message.assistant(CUT),
            finish_reason="length",
            usage=Usage(prompt_tokens=20, completion_tokens=4),
            model="scripted",
            latency_ms=1.0,
        )
    if words.startswith("pay"):
        return ScriptedModel.tool_call("pay")
    if words.startswith("look"):
        if call.messages[-1].role == "tool":
            return ModelError("the provider is down", model="scripted")
        calls = ScriptedModel.tool_call("lookup").tool_calls
        return Message.assistant("Let me look.", tool_calls=calls)
    return f"Answer to {words}"


@tool
def lookup() -> str:
    """Look something up."""
    return "found"


_BANK_ANSWERS = threading.Event()


@tool(side_effect=True, idempotent=False, timeout_s=0.2)
def pay() -> str:
    """Charge the customer's card (the bank answers only when the test ends: in doubt)."""
    _BANK_ANSWERS.wait(30)
    return "charged"


@dataclass
class OpenAIService:
    url: str
    keys: APIKeys
    model: ScriptedModel

    def headers(self, session: str) -> dict[str, str]:
        return {"X-Keel-Session": session, "X-Keel-User": "u1"}

    def sync(self, key: str, session: str = "s1") -> OpenAI:
        """The SDK's client for ``session``, without its own retries (each request is one)."""
        return OpenAI(**self._client_options(key, session))

    def async_(self, key: str, session: str = "s1") -> AsyncOpenAI:
        return AsyncOpenAI(**self._client_options(key, session))

    def _client_options(self, key: str, session: str) -> dict[str, Any]:
        return {
            "base_url": f"{self.url}/v1",
            "api_key": key,
            "default_headers": self.headers(session),
            "max_retries": 0,
        }

    def http(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def facade(tmp_path: Path) -> Iterator[OpenAIService]:
    """The service with the scripted model above; its calls are ``facade.model.calls``."""
    model = ScriptedModel(_answer)
    backends = Backends.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        memory=False,
        settings=load_settings(data_dir=tmp_path, embedder="hashing:64"),
    )
    agents = ServiceAgents(
        backends,
        model,
        system_prompt="You answer.",
        tools=[lookup, pay],
        guards=GuardConfig(max_steps=4),
    )
    keys = APIKeys(backends.sql)
    app = create_app(agents, keys, backends.traces, max_body_bytes=1_000_000)
    try:
        with serving(app) as running:
            yield OpenAIService(running.url, keys, model)
    finally:
        _BANK_ANSWERS.set()
        _settle(agents)
        backends.close()
        _BANK_ANSWERS.clear()


def _settle(agents: ServiceAgents) -> None:
    """Wait until every payment the bank answered late is journalled (its thread writes to
    the store, which must still be open)."""
    deadline = time.monotonic() + 30
    for tenant in agents.tenants():
        journal = agents(tenant).journal
        while journal is not None and journal.in_doubt():
            assert time.monotonic() < deadline, "a late payment was never journalled"
            time.sleep(0.05)
