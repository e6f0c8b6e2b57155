"""What a decision that did not settle its request was: the same decision sent again (an HTTP
retry, a command run twice), which answers as the first did, or another one that lost (a
contrary decision, one on a request cancelled or expired, the loser of a race), which every
channel refuses with the outcome that stands
([`ApprovalSettledError`][keel.errors.ApprovalSettledError])."""

from __future__ import annotations

from keel.approvals._model import ApprovalDecision, ApprovalRequest

__all__ = ["repeats_standing"]


def repeats_standing(request: ApprovalRequest, decision: ApprovalDecision) -> bool:
    """Whether ``decision`` is the one ``request`` stands settled by, sent again: the same
    verdict by the same decider, with the same note, corrected arguments and action (both
    masked alike). When and through which channel it came do not matter."""
    standing = request.decision
    if standing is None or request.status != ("approved" if decision.approve else "rejected"):
        return False
    return (standing.approve, standing.by, standing.note, standing.arguments, standing.action) == (
        decision.approve,
        decision.by,
        decision.note,
        decision.arguments,
        decision.action,
    )
