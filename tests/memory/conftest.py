from __future__ import annotations

import pytest

from keel.memory import SentenceTransformerEmbedder


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2, loaded once for the whole test session."""
    embedder = SentenceTransformerEmbedder()
    embedder.embed(["warm up"])
    return embedder
