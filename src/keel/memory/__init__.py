"""Long-term memory: episodic, semantic and procedural records, retrieved within a budget.

[`Memory`][] is the entry point: ``add`` (PII-masked, durable outbox, embedded off the hot
path), ``search`` (keyword + vector fusion, relevance floor, recency, MMR, neighbouring turns),
``retrieve`` (packed into an exact token budget, labelled with kind, date and provenance),
``remember_fact`` (facts superseded over time, history kept) and ``remember_run`` /
``examples`` (experience replay). Backends live in [`keel.stores`][].
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from keel.memory._config import (
    RetentionPolicies,
    RetentionPolicy,
    RetentionRule,
    RetrievalConfig,
)
from keel.memory._judge import ModelJudge
from keel.memory._packing import PackedItem, PackedMemory, label_for
from keel.memory._records import (
    MemoryFilter,
    MemoryKind,
    MemoryRecord,
    Provenance,
    Scope,
    ShownSession,
)
from keel.memory._text import STOPWORDS, keyword_terms

if TYPE_CHECKING:
    from keel.memory._embedders import (
        DEFAULT_EMBEDDING_MODEL,
        Embedder,
        HashingEmbedder,
        OnnxEmbedder,
        OpenAIEmbedder,
        SentenceTransformerEmbedder,
        default_embedder,
    )
    from keel.memory._memory import EmbeddingStatus, Memory, MemoryHit, ReplayExample
    from keel.memory._retention import PruneReport, prune_memory
    from keel.memory._specs import embedder_from_settings, embedder_from_spec
    from keel.memory._static import StaticEmbedder, distill_minilm
    from keel.memory._store import InsertResult, MemoryStore, OutboxEntry, ScoredId

_NUMPY_BACKED: dict[str, str] = {
    "DEFAULT_EMBEDDING_MODEL": "_embedders",
    "Embedder": "_embedders",
    "HashingEmbedder": "_embedders",
    "OnnxEmbedder": "_embedders",
    "OpenAIEmbedder": "_embedders",
    "SentenceTransformerEmbedder": "_embedders",
    "default_embedder": "_embedders",
    "EmbeddingStatus": "_memory",
    "Memory": "_memory",
    "MemoryHit": "_memory",
    "ReplayExample": "_memory",
    "PruneReport": "_retention",
    "prune_memory": "_retention",
    "embedder_from_settings": "_specs",
    "embedder_from_spec": "_specs",
    "StaticEmbedder": "_static",
    "distill_minilm": "_static",
    "InsertResult": "_store",
    "MemoryStore": "_store",
    "OutboxEntry": "_store",
    "ScoredId": "_store",
}
"""Names whose modules import numpy (vectors, embedders, the store's arrays): loaded on first
use, so that an agent with memory off, which needs only the records' types above, never loads
numpy (and OpenBLAS, which starts its threads on import)."""


def __getattr__(name: str) -> Any:
    module = _NUMPY_BACKED.get(name)
    if module is None:
        raise AttributeError(f"module 'keel.memory' has no attribute {name!r}")
    # Lazy: numpy loads with the first memory that is used, never for a memory-off agent.
    value = getattr(importlib.import_module(f"keel.memory.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "STOPWORDS",
    "Embedder",
    "EmbeddingStatus",
    "HashingEmbedder",
    "InsertResult",
    "Memory",
    "MemoryFilter",
    "MemoryHit",
    "MemoryKind",
    "MemoryRecord",
    "MemoryStore",
    "ModelJudge",
    "OnnxEmbedder",
    "OpenAIEmbedder",
    "OutboxEntry",
    "PackedItem",
    "PackedMemory",
    "Provenance",
    "PruneReport",
    "ReplayExample",
    "RetentionPolicies",
    "RetentionPolicy",
    "RetentionRule",
    "RetrievalConfig",
    "Scope",
    "ScoredId",
    "SentenceTransformerEmbedder",
    "ShownSession",
    "StaticEmbedder",
    "default_embedder",
    "distill_minilm",
    "embedder_from_settings",
    "embedder_from_spec",
    "keyword_terms",
    "label_for",
    "prune_memory",
]
