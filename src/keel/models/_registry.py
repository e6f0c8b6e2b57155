"""From a model spec string to a ready :class:`ChatModel`.

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
    the bundled SmolLM2-135M-Instruct, in-process.
``scripted:NAME``
    a :class:`~keel.testing.ScriptedModel` that echoes the last user message, with NAME's
    window and tokenizer (for demos and smoke tests; build one yourself for real scripts).

A bare known OpenAI name (``gpt-4o-mini``) means ``openai:``.
"""

from __future__ import annotations

import os
from typing import Any

from keel.errors import ConfigError, UnknownModelError
from keel.models._base import ChatModel
from keel.models._retry import RetryPolicy
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
        settings: where base URL and key come from (default: :func:`keel.settings.load_settings`).
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
        from keel.models._local import LocalModel

        return LocalModel(name, **options)
    if provider == "scripted":
        from keel.models._scripted import ScriptedCall, ScriptedModel

        def echo(call: ScriptedCall) -> str:
            return call.last_user_text

        return ScriptedModel(echo, model=name, **options)
    from keel.models._openai import OpenAICompatibleModel

    if provider == "openai":
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
    if provider == "openai-compatible":
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
    if provider == "azure":
        if "client" not in options:
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
    raise UnknownModelError(spec, "providers: openai, openai-compatible, azure, local, scripted")
