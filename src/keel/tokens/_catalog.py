"""What keel knows about each model: its encoding, context window and chat framing.

Names are matched by the longest known prefix after any provider prefix is removed, so dated
snapshots (``gpt-4o-2024-08-06``) and Azure deployment spellings (``gpt-35-turbo``) resolve.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import UnknownModelError

__all__ = ["ChatFormat", "ModelProfile", "known_models", "model_profile", "split_model_spec"]

ChatFormat = Literal["openai", "chatml"]
"""How messages are framed in the prompt: OpenAI's chat format, or ChatML templates."""

ESTIMATE_SAFETY_FACTOR = 1.25
"""Padding applied to counts for models whose tokenizer keel does not have."""

UNKNOWN_MODEL_WINDOW = 8192
"""Context window assumed for an unknown model: small on purpose, so prompts stay safe."""


class ModelProfile(BaseModel):
    """A model's token facts: how to count for it and how much fits."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="The model name as given (provider prefix removed).")
    encoding: str = Field(description="Encoding name: cl100k_base, o200k_base or gguf:NAME.")
    context_window: int = Field(gt=0, description="Tokens the model accepts, prompt + answer.")
    max_output_tokens: int = Field(gt=0, description="Most tokens the model may generate.")
    chat_format: ChatFormat = Field(description="How messages are framed in the prompt.")
    exact: bool = Field(default=True, description="False when counts are padded estimates.")


_OPENAI: tuple[tuple[str, str, int, int], ...] = (
    # prefix, encoding, context window, max output tokens
    ("gpt-5", "o200k_base", 400_000, 128_000),
    ("gpt-4.5", "o200k_base", 128_000, 16_384),
    ("gpt-4.1", "o200k_base", 1_047_576, 32_768),
    ("gpt-4o-mini", "o200k_base", 128_000, 16_384),
    ("gpt-4o", "o200k_base", 128_000, 16_384),
    ("chatgpt-4o", "o200k_base", 128_000, 16_384),
    ("o1-mini", "o200k_base", 128_000, 65_536),
    ("o1", "o200k_base", 200_000, 100_000),
    ("o3-mini", "o200k_base", 200_000, 100_000),
    ("o3", "o200k_base", 200_000, 100_000),
    ("o4-mini", "o200k_base", 200_000, 100_000),
    ("gpt-4-turbo", "cl100k_base", 128_000, 4_096),
    ("gpt-4-1106", "cl100k_base", 128_000, 4_096),
    ("gpt-4-0125", "cl100k_base", 128_000, 4_096),
    ("gpt-4-32k", "cl100k_base", 32_768, 4_096),
    ("gpt-4", "cl100k_base", 8_192, 4_096),
    ("gpt-3.5-turbo-instruct", "cl100k_base", 4_096, 4_096),
    ("gpt-3.5-turbo", "cl100k_base", 16_385, 4_096),
    ("gpt-35-turbo", "cl100k_base", 16_385, 4_096),
    ("text-embedding-3", "cl100k_base", 8_191, 1),
    ("text-embedding-ada-002", "cl100k_base", 8_191, 1),
)

_LOCAL: dict[str, tuple[str, int, int]] = {
    # name: encoding, context window, max output tokens
    "smollm2": ("gguf:smollm2", 8_192, 2_048),
}

_PROVIDERS = ("openai", "openai-compatible", "azure", "local", "scripted")


def split_model_spec(spec: str) -> tuple[str, str]:
    """``"openai:gpt-4o"`` -> ``("openai", "gpt-4o")``; a bare name has provider ``""``.

    For ``openai-compatible:MODEL@URL`` the URL is dropped from the name.
    """
    provider, sep, rest = spec.partition(":")
    if not sep or provider not in _PROVIDERS:
        return "", spec
    name = rest.split("@", 1)[0] if provider == "openai-compatible" else rest
    return provider, name


def known_models() -> list[str]:
    """Model name prefixes with exact token counts."""
    return [prefix for prefix, *_ in _OPENAI] + [f"local:{name}" for name in _LOCAL]


def model_profile(spec: str, *, allow_estimate: bool = False) -> ModelProfile:
    """The profile for a model name or spec.

    Args:
        spec: ``gpt-4o``, ``openai:gpt-4o-mini``, ``local:smollm2``, ...
        allow_estimate: for a name keel does not know, return a padded estimate
            (``exact=False``, a small window) instead of raising.

    Raises:
        UnknownModelError: the name is not known and ``allow_estimate`` is False.
    """
    provider, name = split_model_spec(spec.strip())
    lowered = name.lower()
    if not lowered:
        raise UnknownModelError(spec, "the model name is empty")
    if provider == "local" or lowered in _LOCAL:
        local = _LOCAL.get(lowered)
        if local is None:
            raise UnknownModelError(spec, f"local models: {', '.join(_LOCAL)}")
        encoding, window, max_output = local
        return ModelProfile(
            name=lowered,
            encoding=encoding,
            context_window=window,
            max_output_tokens=max_output,
            chat_format="chatml",
        )
    # Azure and proxies sometimes prefix deployments: "my-org/gpt-4o" -> "gpt-4o".
    bare = lowered.rsplit("/", 1)[-1]
    for prefix, encoding, window, max_output in _OPENAI:
        if bare.startswith(prefix):
            return ModelProfile(
                name=name,
                encoding=encoding,
                context_window=window,
                max_output_tokens=max_output,
                chat_format="openai",
            )
    if not allow_estimate:
        raise UnknownModelError(
            spec, "no exact tokenizer for it; known: " + ", ".join(known_models())
        )
    return ModelProfile(
        name=name,
        encoding="o200k_base",
        context_window=UNKNOWN_MODEL_WINDOW,
        max_output_tokens=1_024,
        chat_format="openai",
        exact=False,
    )
