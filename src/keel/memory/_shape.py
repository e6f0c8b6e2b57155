"""The shape of a question: one event ("What did Maria cook on 3 May?") or something broad
("What books has Melanie read?"), and the retrieval settings each shape gets.

A question about one event has its answer in one conversation: past tense ("did", "was",
"were") or a "when" / "why" about it, or a date or relative time it names. Its best few hits
hold the answer, so the later hits' neighbouring turns are spent tokens
(``narrow_context_hits``). A broad question (a habit, a list, a trait) gathers its answer from
several conversations, so it may get the turns near its hits that rank well themselves
(``broad_reach``) and hits spread over sessions (``broad_spread``). The rule is fixed here, not
tuned: only the levers' constants are, by ``keel bench locomo --cv``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from keel.memory._config import RetrievalConfig
from keel.memory._temporal import TimeRange, time_ranges

__all__ = ["broad_question", "is_broad", "settings_for_shape", "shaped_config"]

_ONE_EVENT = re.compile(r"\b(did|was|were|when|why)\b", re.IGNORECASE)


def is_broad(query: str, now: datetime) -> bool:
    """Whether ``query`` asks about something broad rather than one event."""
    return broad_question(query, time_ranges(query, now))


def broad_question(query: str, ranges: Sequence[TimeRange]) -> bool:
    """`is_broad` of ``query``, given the time ranges it names (``time_ranges``)."""
    return not ranges and not _ONE_EVENT.search(query)


def shaped_config(config: RetrievalConfig, query: str, now: datetime) -> RetrievalConfig:
    """``config`` as it applies to ``query``'s shape (``config`` itself when no shape lever
    is on); the result has its shape levers off, so applying it again changes nothing."""
    if not (config.narrow_context_hits or config.broad_reach or config.broad_spread):
        return config
    return settings_for_shape(config, is_broad(query, now))


def settings_for_shape(config: RetrievalConfig, broad: bool) -> RetrievalConfig:
    """`shaped_config` for a question that is ``broad`` (or about one event)."""
    if not (config.narrow_context_hits or config.broad_reach or config.broad_spread):
        return config
    update: dict[str, float] = {"narrow_context_hits": 0, "broad_reach": 0, "broad_spread": 0.0}
    if broad:
        if config.broad_reach:
            update["context_reach"] = config.broad_reach
        if config.broad_spread:
            update["session_spread"] = config.broad_spread
            update["spread_after"] = config.broad_spread_after
    elif config.narrow_context_hits:
        update["context_hits"] = config.narrow_context_hits
    return config.model_copy(update=update)
