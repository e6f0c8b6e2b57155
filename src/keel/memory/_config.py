"""Retrieval settings, with defaults tuned on the LoCoMo development split."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RetrievalConfig"]


class RetrievalConfig(BaseModel):
    """How [`keel.memory.Memory.search`][] finds and ranks memories.

    Stopword-aware BM25 (without the words most of a scope's rows hold) and dense similarity
    weigh the same in reciprocal-rank fusion, each turn is embedded with the turn before it,
    and a hit is shown with the neighbouring turn on each side. ``rrf_k`` and the recency
    boost were chosen on the LoCoMo dev split (five conversations; see ``keel bench locomo``).
    The levers after them (``temporal_weight``, ``expansion_*``, ``session_spread``,
    ``wide_hits``, ``context_hits``) are what ``keel bench locomo --cv``'s procedure picks on
    all five conversations; its leave-one-conversation-out figure is their honest measure.
    """

    model_config = ConfigDict(frozen=True)

    candidates: int = Field(default=100, ge=1, description="Candidates taken from each retriever.")
    keyword_weight: float = Field(default=1.0, ge=0, description="Weight of the keyword ranking.")
    vector_weight: float = Field(default=1.0, ge=0, description="Weight of the vector ranking.")
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
    context_turns: int = Field(
        default=1,
        ge=0,
        le=16,
        description="Earlier turns of its session embedded with a turn, after it: a reply such "
        "as 'yes, with my kids last week' is found by what it answers (0: each turn alone). "
        "Applies to vectors embedded from then on.",
    )
    recency_weight: float = Field(
        default=0.05, ge=0, description="Boost for recent memories (0 disables)."
    )
    recency_half_life_days: float = Field(
        default=30.0, gt=0, description="Age at which the recency boost halves."
    )
    temporal_weight: float = Field(
        default=4.0,
        ge=0,
        description="Boost for a memory whose time falls in a date or relative time the query "
        "names ('on 7 July, 2023', 'in May', 'last week'): its fused score is multiplied by "
        "1 + this (0 disables).",
    )
    expansion_weight: float = Field(
        default=0.0,
        ge=0,
        description="Weight of a second keyword search for the names the best hits mention "
        "and the query does not (multi-hop expansion; 0 disables).",
    )
    expansion_seeds: int = Field(
        default=3, ge=1, le=10, description="Best hits whose names the expansion searches for."
    )
    session_spread: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Per hit already picked from the same session, a candidate's relevance is "
        "multiplied by 1 - this: answers that span sessions get hits in each (0 disables).",
    )
    wide_hits: int = Field(
        default=6,
        ge=0,
        description="The best this many hits are shown with one more turn on each side than "
        "``neighbours`` (spends more of the token budget on the likeliest context; nothing "
        "when ``neighbours`` is 0).",
    )
    context_hits: int = Field(
        default=0,
        ge=0,
        description="Only the best this many hits are shown with their neighbouring turns; "
        "later hits come alone (0: every hit). Frees tokens where context rarely helps.",
    )
    judge_candidates: int = Field(
        default=20, ge=1, description="Candidates shown to the optional model judge."
    )
