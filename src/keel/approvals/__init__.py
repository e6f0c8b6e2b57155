"""Human approval of consequential tool calls, and escalation of turns to an operator.

See :mod:`keel.approvals._model`: :class:`ApprovalRequest` (one call waiting), the
:class:`ApprovalStore` queue (SQLite and PostgreSQL implementations live in ``keel.stores``),
and :class:`ApprovalDecision`.
"""

from __future__ import annotations

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

__all__ = [
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "Channel",
    "Decider",
    "repeats_standing",
]
