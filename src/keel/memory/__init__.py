"""Long-term memory: episodic, semantic and procedural records, retrieved within a budget.

[`Memory`][] is the entry point: ``add`` (PII-masked, durable outbox, embedded off the hot
path), ``search`` (keyword + vector fusion, relevance floor, recency, MMR, neighbouring turns),
``retrieve`` (packed into an exact token budget, labelled with kind, date and provenance),
``remember_fact`` (facts superseded over time, history kept) and ``remember_run`` /
``examples`` (experience replay). Backends live in [`keel.stores`][].
"""

from __future__ import annotations

from keel.memory._config import (
    RetentionPolicies,
    RetentionPolicy,
    RetentionRule,
    RetrievalConfig,
)
from keel.memory._embedders import (
    DEFAULT_EMBEDDING_MODEL,
    Embedder,
    HashingEmbedder,
    OnnxEmbedder,
    OpenAIEmbedder,
    SentenceTransformerEmbedder,
    default_embedder,
)
from keel.memory._judge import ModelJudge
from keel.memory._memory import EmbeddingStatus, Memory, MemoryHit, ReplayExample
from keel.memory._packing import PackedItem, PackedMemory, label_for
from keel.memory._records import (
    MemoryFilter,
    MemoryKind,
    MemoryRecord,
    Provenance,
    Scope,
    ShownSession,
)
from keel.memory._retention import PruneReport, prune_memory
from keel.memory._specs import embedder_from_settings, embedder_from_spec
from keel.memory._static import StaticEmbedder, distill_minilm
from keel.memory._store import InsertResult, MemoryStore, OutboxEntry, ScoredId
from keel.memory._text import STOPWORDS, keyword_terms

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
