"""From a model spec string to a ready [`ChatModel`][].

Specs:

``openai:MODEL``
    OpenAI itself; the key from ``KEEL_OPENAI_API_KEY`` or ``OPENAI_API_KEY``.
``openai-compatible:MODEL@URL``
    any OpenAI-compatible server (vLLM, Ollama, llama.cpp, LM Studio) at ``URL``; without
    ``@URL`` the base URL comes from ``KEEL_OPENAI_BASE_URL``. Local servers need no key.
``azure:DEPLOYMENT``
    Azure OpenAI; endpoint, key and API version from the SDK's usual ``AZURE_OPENAI_ENDPOINT``,
    ``AZURE_OPENAI_API_KEY`` and ``OPENAI_API_VERSION`` variables.
``local:smollm2``
    the bundled SmolLM2-135M-Instruct, in-process; each answer at most
    ``local_max_answer_tokens`` tokens (``KEEL_LOCAL_MAX_ANSWER_TOKENS``, default 384), or the
    spec's own cap: ``local:smollm2?max_answer_tokens=256``.
``scripted:NAME``
    a [`ScriptedModel`][] that echoes the last user message, with NAME's
    window and tokenizer (for demos and smoke tests; build one yourself for real scripts).

A bare known OpenAI name (``gpt-4o-mini``) means ``openai:``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from keel.errors import ConfigError, UnknownModelError
from keel.models._base import ChatModel
from keel.models._local import LocalModel
from keel.models._openai import OpenAICompatibleModel
from keel.models._retry import RetryPolicy
from keel.models._scripted import ScriptedCall, ScriptedModel
from keel.settings import Settings, load_settings
from keel.tokens import counter_for, model_profile, split_model_spec

__all__ = ["resolve_model"]


def _api_key(settings: Settings) -> str | None:
    if settings.openai_api_key is not None:
        return settings.openai_api_key.get_secret_value()
    return None


def resolve_model(
    spec: str | None = None,
    settings: Settings | None = None,
    *,
    retry: RetryPolicy | None = None,
    **options: Any,
) -> ChatModel:
    """The chat model a spec names (default: the ``model`` setting, ``local:smollm2``).

    Args:
        spec: ``openai:gpt-4o-mini``, ``openai-compatible:MODEL@http://host:port/v1``,
            ``azure:DEPLOYMENT``, ``local:smollm2`` or ``scripted:NAME``.
        settings: where base URL and key come from (default: [`keel.settings.load_settings`][]).
        retry: the retry policy for HTTP models.
        **options: passed to the model class (``n_ctx`` for the local model, ``client`` or
            ``default_headers`` for HTTP models).

    Raises:
        UnknownModelError: the spec names no model keel can run.
        ConfigError: the spec needs a setting (base URL, key) that is missing.
    """
    if spec is None or settings is None:
        settings = settings or load_settings()
    spec = (spec or settings.model).strip()
    provider, name = split_model_spec(spec)
    if not name:
        raise UnknownModelError(spec, "the model name is empty")
    if provider == "":
        # A bare name: a known OpenAI model, or the bundled local one.
        profile = model_profile(spec)
        provider = "local" if profile.chat_format == "chatml" else "openai"
        spec = f"{provider}:{name}"
    if provider == "local":
        name, cap = _local_answer_cap(spec, name, settings)
        options.setdefault("max_answer_tokens", cap)
        return LocalModel(name, **options)
    if provider == "scripted":
        return ScriptedModel(_echo_last_user, model=name, **options)
    http_model = _HTTP_PROVIDERS.get(provider)
    if http_model is None:
        raise UnknownModelError(
            spec, "providers: openai, openai-compatible, azure, local, scripted"
        )
    return http_model(spec, name, settings, retry, options)


def _local_answer_cap(spec: str, name: str, settings: Settings) -> tuple[str, int]:
    """A local spec's model name and answer cap: ``?max_answer_tokens=N`` when the spec
    gives one, else the ``local_max_answer_tokens`` setting."""
    name, _, query = name.partition("?")
    if not query:
        return name, settings.local_max_answer_tokens
    key, _, value = query.partition("=")
    if key != "max_answer_tokens" or not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{spec}: a local model spec takes one option, ?max_answer_tokens=N (N >= 1)"
        )
    return name, int(value)


def _echo_last_user(call: ScriptedCall) -> str:
    return call.last_user_text


def _openai_model(
    spec: str, name: str, settings: Settings, retry: RetryPolicy | None, options: dict[str, Any]
) -> ChatModel:
    key = _api_key(settings) or os.environ.get("OPENAI_API_KEY")
    if not key and "client" not in options:
        raise ConfigError(f"{spec} needs an API key: set KEEL_OPENAI_API_KEY or OPENAI_API_KEY")
    return OpenAICompatibleModel(
        name,
        base_url=settings.openai_base_url,
        api_key=key,
        retry=retry,
        spec=spec,
        counter=counter_for(name, allow_estimate=True),
        max_tokens_param="max_completion_tokens",
        **options,
    )


def _compatible_model(
    spec: str, name: str, settings: Settings, retry: RetryPolicy | None, options: dict[str, Any]
) -> ChatModel:
    _, _, url = spec.partition(":")[2].partition("@")
    base_url = url or settings.openai_base_url
    if not base_url:
        raise ConfigError(
            f"{spec} names no server: write openai-compatible:MODEL@http://host:port/v1 "
            "or set KEEL_OPENAI_BASE_URL"
        )
    return OpenAICompatibleModel(
        name,
        base_url=base_url,
        # Local servers ignore the key, but the SDK insists on one.
        api_key=_api_key(settings) or os.environ.get("OPENAI_API_KEY") or "not-needed",
        retry=retry,
        spec=spec,
        **options,
    )


def _azure_model(
    spec: str, name: str, settings: Settings, retry: RetryPolicy | None, options: dict[str, Any]
) -> ChatModel:
    if "client" not in options:
        # The SDK takes a third of a second to import: only a model that calls it pays.
        from openai import AsyncAzureOpenAI, OpenAIError

        try:
            options["client"] = AsyncAzureOpenAI(max_retries=0)
        except OpenAIError as exc:
            raise ConfigError(
                f"{spec}: set AZURE_OPENAI_ENDPOINT, AZURE_OPENAI_API_KEY and "
                f"OPENAI_API_VERSION ({exc})"
            ) from exc
    return OpenAICompatibleModel(
        name,
        retry=retry,
        spec=spec,
        counter=counter_for(name, allow_estimate=True),
        **options,
    )


_HTTP_PROVIDERS: dict[
    str, Callable[[str, str, Settings, RetryPolicy | None, dict[str, Any]], ChatModel]
] = {
    "openai": _openai_model,
    "openai-compatible": _compatible_model,
    "azure": _azure_model,
}
