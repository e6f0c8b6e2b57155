"""Retrieval settings, with defaults tuned on the LoCoMo development split."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RetrievalConfig"]


class RetrievalConfig(BaseModel):
    """How :meth:`keel.memory.Memory.search` finds and ranks memories.

    The defaults were tuned on the LoCoMo dev split (five conversations; see ``keel bench
    locomo``): stopword-aware BM25 weighted above dense similarity in reciprocal-rank fusion,
    plus the neighbouring turn on each side of a hit.
    """

    model_config = ConfigDict(frozen=True)

    candidates: int = Field(default=100, ge=1, description="Candidates taken from each retriever.")
    keyword_weight: float = Field(default=1.0, ge=0, description="Weight of the keyword ranking.")
    vector_weight: float = Field(default=0.5, ge=0, description="Weight of the vector ranking.")
    rrf_k: float = Field(
        default=10.0, gt=0, description="Reciprocal-rank constant: lower trusts top ranks more."
    )
    min_similarity: float = Field(
        default=0.1,
        description="Calibrated floor: a vector-only candidate under this cosine is dropped.",
    )
    mmr_lambda: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Maximal marginal relevance trade-off (1.0: pure relevance, lower: more "
        "diverse). Near-duplicates are always removed.",
    )
    duplicate_similarity: float = Field(
        default=0.97, description="Cosine above which a candidate repeats a better one."
    )
    neighbours: int = Field(
        default=1, ge=0, description="Turns before and after a hit shown with it (same session)."
    )
    recency_weight: float = Field(
        default=0.05, ge=0, description="Boost for recent memories (0 disables)."
    )
    recency_half_life_days: float = Field(
        default=30.0, gt=0, description="Age at which the recency boost halves."
    )
    judge_candidates: int = Field(
        default=20, ge=1, description="Candidates shown to the optional model judge."
    )
