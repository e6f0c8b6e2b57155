from __future__ import annotations

import pytest

from keel.errors import ConfigError, UnknownModelError
from keel.messages import Message
from keel.models import LocalModel, OpenAICompatibleModel, RetryPolicy, resolve_model
from keel.settings import load_settings
from keel.testing import FaultServer, ScriptedModel


def test_openai_compatible_spec_with_url(fault_server: FaultServer) -> None:
    retry = RetryPolicy(max_attempts=2)
    model = resolve_model(f"openai-compatible:ok@{fault_server.base_url}", retry=retry)
    assert isinstance(model, OpenAICompatibleModel)
    assert model.model == "ok" and model.base_url == fault_server.base_url
    assert model.retry is retry
    assert model.spec == f"openai-compatible:ok@{fault_server.base_url}"
    assert model.complete([Message.user("hi")]).text == "Hello from the fault server."


def test_openai_compatible_base_url_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    model = resolve_model("openai-compatible:llama3")
    assert isinstance(model, OpenAICompatibleModel) and model.base_url == "http://127.0.0.1:9/v1"
    assert not model.counter.exact  # an unknown model gets a padded estimate
    monkeypatch.delenv("KEEL_OPENAI_BASE_URL")
    with pytest.raises(ConfigError, match="names no server"):
        resolve_model("openai-compatible:llama3")


def test_openai_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="API key"):
        resolve_model("openai:gpt-4o-mini")
    monkeypatch.setenv("KEEL_OPENAI_API_KEY", "sk-test")
    model = resolve_model("openai:gpt-4o-mini")
    assert isinstance(model, OpenAICompatibleModel)
    assert model.context_window == 128_000 and model.counter.exact
    assert model.max_tokens_param == "max_completion_tokens"
    bare = resolve_model("gpt-4o-mini")
    assert isinstance(bare, OpenAICompatibleModel) and bare.spec == "openai:gpt-4o-mini"


def test_local_and_default_spec() -> None:
    model = resolve_model("local:smollm2", n_ctx=1024)
    assert isinstance(model, LocalModel)
    assert model.context_window == 1024 and model.profile.context_window == 8192
    default = resolve_model(settings=load_settings())
    assert isinstance(default, LocalModel)  # the embedded default needs no network
    with pytest.raises(UnknownModelError):
        resolve_model("local:llama-70b")


def test_scripted_spec_echoes() -> None:
    model = resolve_model("scripted:gpt-4o-mini")
    assert isinstance(model, ScriptedModel)
    assert model.complete([Message.user("ping")]).text == "ping"
    assert model.context_window == 128_000


def test_unknown_specs() -> None:
    with pytest.raises(UnknownModelError):
        resolve_model("no-such-model")
    with pytest.raises(UnknownModelError):
        resolve_model("openai:")
