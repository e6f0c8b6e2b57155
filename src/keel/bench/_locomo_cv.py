"""Leave-one-conversation-out cross-validation of retrieval levers (``keel bench locomo --cv``).

Every constant a retrieval lever introduces is chosen on four conversations and scored on the
fifth, all five ways, so the figure says how the retrieval does on a conversation its
constants never saw. The procedure, fixed in code and printed with the report:

* Each lever has a grid of values whose first is "off" (the lever does nothing).
* Coordinate ascent in the order of ``LEVER_GRIDS``: starting from every lever off, each lever
  takes the grid value with the best mean R@10 over the training conversations' questions,
  given the values chosen before it, among the values whose mean tokens retrieved stay within
  the budget (1,000 by default). Ties keep the earlier value (off first).
* The chosen setting is scored on the held-out conversation; the mean, each fold and the
  spread (max - min) of those scores are the cross-validated figure.

The selection only ever asks the scorer about the training conversations: a test runs it with
a scorer that fails when asked about the held-out one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LEVER_GRIDS",
    "MEASURED_GRIDS",
    "PROCEDURE",
    "Score",
    "Setting",
    "choose",
    "cross_validate",
    "lever_alone",
]

Setting = tuple[tuple[str, float], ...]
"""Retrieval-config overrides, as sorted ``(field, value)`` pairs (hashable: a cache key)."""

LEVER_GRIDS: dict[str, tuple[dict[str, float], ...]] = {
    "temporal": tuple({"temporal_weight": w} for w in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)),
    "expansion": (
        {"expansion_weight": 0.0},
        {"expansion_weight": 0.25, "expansion_seeds": 1},
        {"expansion_weight": 0.5, "expansion_seeds": 1},
        {"expansion_weight": 0.25, "expansion_seeds": 3},
        {"expansion_weight": 0.5, "expansion_seeds": 3},
    ),
    "shape": tuple(
        {"narrow_context_hits": narrow, "broad_reach": reach}
        for narrow in (0, 7, 6, 5)
        for reach in (0, 4, 8)
    ),
    "broad_spread": (
        {"broad_spread": 0.0, "broad_spread_after": 0},
        *(
            {"broad_spread": spread, "broad_spread_after": after}
            for after in (2, 4, 6, 7)
            for spread in (0.5, 0.9)
        ),
    ),
    "budget": tuple(
        {"wide_hits": wide, "context_hits": tail}
        for tail in (0, 7, 5, 9)
        for wide in (0, 2, 4, 6, 8)
    ),
}
"""The levers kept, each with its grid; the first value of each is off. The dates' grid
reaches 16 since 4, its old top, was picked in every fold (2026-12-06). Budget: how the
tokens are spread over the ranks: the best ``wide_hits`` hits show one more turn on each side,
hits after the best ``context_hits`` show none (0: all do); the token limit binds there.
Shape (2026-12-07): a question about one event (past tense, "when", "why", a date) shows
neighbours for its best ``narrow_context_hits`` hits only; a broad one shows the well-ranked
turns up to ``broad_reach`` from a hit, and spreads its hits after the best
``broad_spread_after`` over sessions (``broad_spread``). Shape and spread come before the
budget: after it, no token was left for them (every fold then took the shape lever's reach
and nothing of the spread; CV session-level stayed at 0.903)."""

MEASURED_GRIDS: dict[str, tuple[dict[str, float], ...]] = {
    "session_spread": (
        {"session_spread": 0.0, "spread_after": 0},
        {"session_spread": 0.2, "spread_after": 0},
        {"session_spread": 0.35, "spread_after": 0},
        {"session_spread": 0.5, "spread_after": 6},
        {"session_spread": 0.9, "spread_after": 6},
        {"session_spread": 0.9, "spread_after": 8},
    ),
    "reach": tuple({"context_reach": r} for r in (0, 2, 3, 4, 6, 8)),
}
"""Levers measured alone (cross-validated the same way) but not kept, off by default. Session
spread (from the first hit, or sparing the best ``spread_after``) was never chosen on any
fold: it buys session-level recall with turn-level recall and tokens. Reach (turns near a hit
that rank on their own) alone about matches the budget lever (CV 0.833 against 0.831 on
2026-12-06, at the same tokens), and the budget lever already spends the tokens."""

PROCEDURE = (
    "leave-one-conversation-out; per fold, coordinate ascent over the levers in the order "
    + ", ".join(LEVER_GRIDS)
    + ": from all off, each lever takes the grid value with the best mean R@10 on the four "
    "training conversations (mean tokens within the budget; ties keep the earlier value, off "
    "first); the chosen setting is scored on the held-out conversation"
)


@dataclass(frozen=True)
class Score:
    """A setting's figures over some conversations' questions (question-weighted means)."""

    recall_at_10: float
    session_recall_at_10: float
    tokens_at_10: float
    questions: int


Scorer = Callable[[Setting, Sequence[str]], Score]
"""Scores a setting on the named conversations (and only those)."""


def setting_of(overrides: Mapping[str, float]) -> Setting:
    """The hashable form of a config override mapping."""
    return tuple(sorted(overrides.items()))


def _merge(base: Setting, overrides: Mapping[str, float]) -> Setting:
    merged = dict(base)
    merged.update(overrides)
    return setting_of(merged)


def choose(
    score: Scorer,
    training: Sequence[str],
    *,
    grids: Mapping[str, Sequence[Mapping[str, float]]] = LEVER_GRIDS,
    max_tokens: float = 1000.0,
) -> Setting:
    """The setting the procedure picks on ``training`` conversations (see the module doc)."""
    chosen: Setting = setting_of({k: v for grid in grids.values() for k, v in grid[0].items()})
    for grid in grids.values():
        best: tuple[float, Setting] | None = None
        for overrides in grid:
            candidate = _merge(chosen, overrides)
            result = score(candidate, training)
            if result.tokens_at_10 > max_tokens:
                continue
            if best is None or result.recall_at_10 > best[0]:
                best = (result.recall_at_10, candidate)
        if best is not None:
            chosen = best[1]
    return chosen


def lever_alone(
    lever: str, grids: Mapping[str, Sequence[Mapping[str, float]]] = LEVER_GRIDS
) -> dict[str, Sequence[Mapping[str, float]]]:
    """Grids where only ``lever`` moves: every other lever has just its off value."""
    return {name: grid if name == lever else grid[:1] for name, grid in grids.items()}


def cross_validate(
    score: Scorer,
    conversations: Sequence[str],
    *,
    grids: Mapping[str, Sequence[Mapping[str, float]]] = LEVER_GRIDS,
    max_tokens: float = 1000.0,
) -> dict[str, Any]:
    """Leave-one-conversation-out: per fold the setting chosen on the others, scored on it.

    Returns ``recall_at_10_mean``, ``recall_at_10_spread``, ``folds`` (held-out
    conversation, the setting chosen without it, its training and held-out figures),
    ``session_recall_at_10_mean``, ``tokens_at_10_mean`` and ``chosen_on_all`` (what the
    procedure picks on every conversation: the setting to ship).
    """
    folds: list[dict[str, Any]] = []
    for held_out in conversations:
        training = [name for name in conversations if name != held_out]
        setting = choose(score, training, grids=grids, max_tokens=max_tokens)
        trained = score(setting, training)
        tested = score(setting, [held_out])
        folds.append(
            {
                "held_out": held_out,
                "chosen": dict(setting),
                "train_recall_at_10": round(trained.recall_at_10, 4),
                "recall_at_10": round(tested.recall_at_10, 4),
                "session_recall_at_10": round(tested.session_recall_at_10, 4),
                "tokens_at_10": round(tested.tokens_at_10, 1),
                "questions": tested.questions,
            }
        )
    recalls = [fold["recall_at_10"] for fold in folds]
    return {
        "recall_at_10_mean": round(statistics.fmean(recalls), 4),
        "recall_at_10_spread": round(max(recalls) - min(recalls), 4),
        "recall_at_10_min": round(min(recalls), 4),
        "session_recall_at_10_mean": round(
            statistics.fmean(fold["session_recall_at_10"] for fold in folds), 4
        ),
        "tokens_at_10_mean": round(statistics.fmean(fold["tokens_at_10"] for fold in folds), 1),
        "folds": folds,
        "chosen_on_all": dict(choose(score, conversations, grids=grids, max_tokens=max_tokens)),
    }
