"""Embedders from their specs (``KEEL_EMBEDDER``): the one place a spec becomes a model.

The memory *store* is opened with the rest of keel's stores, by
[`keel.stores.Backends.open`][]."""

from __future__ import annotations

from keel.errors import ConfigError
from keel.memory._embedders import (
    Embedder,
    HashingEmbedder,
    OnnxEmbedder,
    OpenAIEmbedder,
    SentenceTransformerEmbedder,
)
from keel.memory._static import StaticEmbedder
from keel.settings import Settings

__all__ = ["embedder_from_settings", "embedder_from_spec"]


def embedder_from_spec(spec: str, settings: Settings | None = None) -> Embedder:
    """An embedder from a spec.

    ``local:all-minilm-l6-v2`` (the bundled default, on ONNX Runtime), ``local:/path/to/folder``
    (another BERT-family sentence-transformers folder, on ONNX Runtime), ``local:minilm-static``
    (static embeddings distilled from the bundled model on first use, kept in the data folder's
    ``models``; ``local:minilm-static/128`` for another dimension), ``model2vec:/path/to/folder``
    (any model2vec folder),
    ``sentence-transformers:/path/to/folder`` (any sentence-transformers model, through torch),
    ``hashing:256`` (no model), ``openai:MODEL/DIM`` or
    ``openai-compatible:MODEL/DIM@http://host:port/v1``.

    Raises:
        ConfigError: an unknown or incomplete spec.
    """
    kind, _, rest = spec.partition(":")
    if kind == "local" and rest.lower().partition("/")[0] == "minilm-static":
        cache = settings.data_dir / "models" if settings is not None else None
        return StaticEmbedder(dimension=_dimension(spec, rest.partition("/")[2]), cache_dir=cache)
    if kind == "model2vec":
        if not rest:
            raise ConfigError(f"embedder spec {spec!r} needs a folder: model2vec:/path/to/folder")
        return StaticEmbedder(rest)
    if kind == "local":
        if rest.lower() in {"all-minilm-l6-v2", "minilm", ""}:
            return OnnxEmbedder()
        return OnnxEmbedder(rest)
    if kind == "sentence-transformers":
        return SentenceTransformerEmbedder(rest or None)
    if kind == "hashing":
        return HashingEmbedder(_dimension(spec, rest))
    if kind in {"openai", "openai-compatible"}:
        target, _, url = rest.partition("@")
        model, _, dim = target.rpartition("/")
        if not model or not dim.isdigit():
            raise ConfigError(
                f"embedder spec {spec!r} needs MODEL/DIMENSION, "
                "e.g. openai:text-embedding-3-small/1536"
            )
        key = (
            settings.openai_api_key.get_secret_value()
            if settings and settings.openai_api_key
            else None
        )
        base = url or (settings.openai_base_url if settings else None)
        return OpenAIEmbedder(model, dimension=_dimension(spec, dim), base_url=base, api_key=key)
    raise ConfigError(
        f"unknown embedder spec {spec!r}: use local:all-minilm-l6-v2, local:FOLDER, "
        "local:minilm-static, model2vec:FOLDER, sentence-transformers:FOLDER, hashing:DIM, "
        "openai:MODEL/DIM or "
        "openai-compatible:MODEL/DIM@URL"
    )


def embedder_from_settings(settings: Settings) -> Embedder:
    """The embedder the settings name (``KEEL_EMBEDDER``): the one every part of keel uses.

    ``Agent.embedded``, ``keel chat`` and ``keel memory reembed`` all resolve it here, so one
    database never holds vectors of two models because one entry point ignored the setting.

    Raises:
        ConfigError: an unknown or incomplete spec.
    """
    return embedder_from_spec(settings.embedder, settings)


_MAX_DIMENSION = 16_000
"""pgvector's largest ``vector``; beyond it no PostgreSQL store could hold the vectors, and a
typo (``hashing:99999999999``) would allocate its matrix."""


def _dimension(spec: str, text: str, default: int = 256) -> int:
    """The dimension a spec names (``default`` when it names none), checked: an embedder of 0
    dimensions divides by zero at its first text."""
    if not text:
        return default
    if not text.isdigit() or not 1 <= int(text) <= _MAX_DIMENSION:
        raise ConfigError(
            f"embedder spec {spec!r}: the dimension must be 1 to {_MAX_DIMENSION}, got {text!r}"
        )
    return int(text)
