"""Human approval of consequential tool calls, and escalation of turns to an operator.

See `keel.approvals._model`: [`ApprovalRequest`][] (one call waiting), the
[`ApprovalStore`][] queue (SQLite and PostgreSQL implementations live in ``keel.stores``),
and [`ApprovalDecision`][], bound to the arguments it approved by
[`arguments_digest`][].
"""

from __future__ import annotations

from keel.approvals._digest import arguments_digest, canonical_arguments
from keel.approvals._model import (
    ApprovalDecision,
    ApprovalKind,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalStore,
    Channel,
    Decider,
)
from keel.approvals._outcome import repeats_standing
from keel.approvals._schema import check_corrected_arguments

__all__ = [
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "Channel",
    "Decider",
    "arguments_digest",
    "canonical_arguments",
    "check_corrected_arguments",
    "repeats_standing",
]
