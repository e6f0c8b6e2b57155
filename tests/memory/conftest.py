from __future__ import annotations

import pytest

from keel.memory import OnnxEmbedder


@pytest.fixture(scope="session")
def minilm() -> OnnxEmbedder:
    """all-MiniLM-L6-v2 (the default embedder), loaded once for the whole test session."""
    embedder = OnnxEmbedder()
    embedder.embed(["warm up"])
    return embedder
