"""Memory's settings: retrieval (defaults tuned on the LoCoMo development split) and
retention (what `keel memory prune` deletes, per tenant and kind)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keel.errors import ConfigError
from keel.memory._records import MemoryKind
from keel.settings import validation_problems

__all__ = [
    "DEFAULT_TENANT",
    "RetentionPolicies",
    "RetentionPolicy",
    "RetentionRule",
    "RetrievalConfig",
]


class RetrievalConfig(BaseModel):
    """How [`keel.memory.Memory.search`][] finds and ranks memories.

    Stopword-aware BM25 (without the words most of a scope's rows hold) and dense similarity
    weigh the same in reciprocal-rank fusion, each turn is embedded with the turn before it,
    and a hit is shown with the neighbouring turn on each side. ``rrf_k`` and the recency
    boost were chosen on the LoCoMo dev split (five conversations; see ``keel bench locomo``).
    The levers after them (``temporal_weight``, ``expansion_*``, the question-shape levers
    ``narrow_context_hits``, ``broad_reach`` and ``broad_spread*``, ``wide_hits``,
    ``context_hits``) are what ``keel bench locomo --cv``'s procedure picks on all five
    conversations; its leave-one-conversation-out figure is their honest measure.
    ``session_spread``, ``spread_after`` and ``context_reach`` are measured there alone, off.
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
        default=8.0,
        ge=0,
        description="Boost for a memory whose time falls in a date or relative time the query "
        "names ('on 7 July, 2023', 'in May', 'last week'): its fused score is multiplied by "
        "1 + this (0 disables).",
    )
    expansion_weight: float = Field(
        default=0.25,
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
    spread_after: int = Field(
        default=0,
        ge=0,
        description="``session_spread`` spares the best this many hits: they are picked by "
        "relevance alone, the later ones spread over sessions (0: every hit spreads).",
    )
    wide_hits: int = Field(
        default=2,
        ge=0,
        description="The best this many hits are shown with one more turn on each side than "
        "``neighbours`` (spends more of the token budget on the likeliest context; nothing "
        "when ``neighbours`` is 0).",
    )
    context_reach: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Turns of a hit's session up to this many away are shown with it when "
        "they rank among the search's best candidates themselves (0: only ``neighbours``; "
        "like ``wide_hits`` it widens a context, never creates one).",
    )
    context_hits: int = Field(
        default=9,
        ge=0,
        description="Only the best this many hits are shown with their neighbouring turns; "
        "later hits come alone (0: every hit). Frees tokens where context rarely helps.",
    )
    narrow_context_hits: int = Field(
        default=0,
        ge=0,
        description="For a question about one event (past tense, 'when', 'why' or a date it "
        "names), only the best this many hits are shown with their neighbouring turns, in "
        "place of ``context_hits`` (0: such a question is treated like any other).",
    )
    broad_reach: int = Field(
        default=8,
        ge=0,
        le=16,
        description="For a broad question (not about one event), ``context_reach`` is this "
        "(0: such a question is treated like any other).",
    )
    broad_spread: float = Field(
        default=0.9,
        ge=0,
        lt=1,
        description="For a broad question, ``session_spread`` is this, sparing the best "
        "``broad_spread_after`` hits (0: such a question is treated like any other).",
    )
    broad_spread_after: int = Field(
        default=4, ge=0, description="The best hits ``broad_spread`` spares."
    )
    judge_candidates: int = Field(
        default=20, ge=1, description="Candidates shown to the optional model judge."
    )


class RetentionRule(BaseModel):
    """How long one kind of memory is kept: by age, by count per user, or both."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_age_days: float | None = Field(
        default=None, gt=0, description="Records older than this many days are deleted."
    )
    max_count: int | None = Field(
        default=None, ge=0, description="Each user keeps this many newest records of the kind."
    )


class RetentionPolicy(BaseModel):
    """One tenant's retention: a rule per kind of memory (a kind without one is kept)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    episodic: RetentionRule | None = None
    semantic: RetentionRule | None = None
    procedural: RetentionRule | None = None

    def rules(self) -> dict[MemoryKind, RetentionRule]:
        """The kinds this policy limits, with their rules."""
        found: dict[MemoryKind, RetentionRule | None] = {
            "episodic": self.episodic,
            "semantic": self.semantic,
            "procedural": self.procedural,
        }
        return {kind: rule for kind, rule in found.items() if rule is not None}


DEFAULT_TENANT = "*"
"""The key of the policy that applies to every tenant without one of its own."""


class RetentionPolicies(BaseModel):
    """Memory retention per tenant (``KEEL_MEMORY_RETENTION``): a tenant's own policy, else
    the ``"*"`` one, else none (everything kept)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[str, RetentionPolicy] = Field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> RetentionPolicies:
        """The policies a setting spells, ``{tenant or "*": {kind: {rule: value}}}``.

        Raises:
            ConfigError: a kind or rule keel does not know, or a value out of range.
        """
        policies: dict[str, RetentionPolicy] = {}
        for tenant, spelled in raw.items():
            try:
                policies[str(tenant)] = RetentionPolicy.model_validate(spelled)
            except ValidationError as exc:
                problems = validation_problems(exc, "the policy")
                raise ConfigError(
                    f"invalid memory_retention for tenant {tenant!r}: {problems} (a policy is "
                    '{"episodic"|"semantic"|"procedural": {"max_age_days": D, "max_count": N}})'
                ) from None
        return cls(tenants=policies)

    def for_tenant(self, tenant_id: str) -> RetentionPolicy | None:
        """The policy ``tenant_id`` is under (its own, else the default), or None."""
        return self.tenants.get(tenant_id, self.tenants.get(DEFAULT_TENANT))

    @property
    def empty(self) -> bool:
        """No policy limits anything: pruning has nothing to do."""
        return not any(policy.rules() for policy in self.tenants.values())
