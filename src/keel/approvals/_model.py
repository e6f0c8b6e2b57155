"""Approval requests: a consequential tool call (or an escalated turn) waiting for a person.

A request is made when the model calls a tool whose approval policy asks for one, or when a
turn escalates (a loop after the warning, a call left in doubt). It waits in the
[`ApprovalStore`][] (the operators' queue, across sessions and processes) until someone
allowed to decide does, or it expires. Deciding is one compare-and-set on the request's status:
two operators deciding at once, or the same decision sent twice, settle it once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "Channel",
    "Decider",
]

ApprovalKind = Literal["user", "operator", "escalation"]
"""Who decides: the session's own ``user`` (a confirmation in the conversation), one of the
tenant's ``operator``\\s (an approval), or an operator answering an ``escalation`` (a turn that
looped again or left a call in doubt: retry, skip, or a text for the model)."""

ApprovalStatus = Literal["pending", "approved", "rejected", "expired", "cancelled"]
"""``pending`` until decided; ``expired`` counts as rejected; ``cancelled`` when the session
was reverted or its turn ended otherwise (with the reason)."""

Decider = Literal["user", "operator"]

Channel = Literal["agent", "conversation", "http", "cli", "viewer", "mcp"]
"""Through which entrance a decision came: ``agent.decide`` in the application's code, the
user's own words in the ``conversation``, the service's ``http`` route, the ``cli``, the web
``viewer``, an ``mcp`` client."""


class ApprovalDecision(BaseModel):
    """What a person decided about one request."""

    model_config = ConfigDict(frozen=True)

    approve: bool = Field(description="True to run the call (or resume the turn).")
    by: str = Field(description="Who decided: ``user:<id>`` or ``operator:<name>``.")
    note: str | None = Field(default=None, description="Why (shown to the model on a rejection).")
    arguments: str | None = Field(
        default=None,
        description="Corrected arguments (JSON, validated like the model's) that the approved "
        "call runs with instead of the requested ones.",
    )
    action: Literal["retry", "skip", "answer"] | None = Field(
        default=None,
        description="For an escalation: run the stopped call again, skip it, or give the model "
        "``note`` as the answer.",
    )
    decided_at: float = Field(description="Epoch seconds.")
    channel: Channel | None = Field(
        default=None, description="Through which entrance the decision came (None: not recorded)."
    )
    recorded_only: bool = Field(
        default=False,
        description="The decider only recorded it (a viewer whose agent lacks the request's "
        "tool; the command line's ``cli`` channel says so by itself): the application's "
        "carrier carries it out at once, instead of leaving it to the decider for a while.",
    )
    arguments_digest: str | None = Field(
        default=None,
        description="SHA-256 (hex) of the exact arguments approved, masked and canonical (the "
        "corrected ones when given, else the request's): a call whose arguments differ needs a "
        "new decision.",
    )


class ApprovalRequest(BaseModel):
    """One call (or escalated turn) waiting for a decision; arguments are stored masked."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="The request's id (stable across retries of the same call).")
    tenant_id: str
    user_id: str
    session_id: str
    turn_id: str
    kind: ApprovalKind
    tool: str | None = Field(default=None, description="The tool (None for an escalation).")
    call_id: str | None = Field(default=None, description="The model's tool call id.")
    arguments: str = Field(default="{}", description="The call's arguments, masked.")
    reason: str = Field(default="", description="Why a person must decide (the policy's words).")
    step: int = Field(default=0, description="The loop step the call belongs to.")
    created_at: float
    expires_at: float | None = Field(default=None, description="Epoch seconds; None: never.")
    status: ApprovalStatus = "pending"
    decision: ApprovalDecision | None = None
    status_reason: str | None = Field(default=None, description="Why it was cancelled or expired.")
    metadata: dict[str, Any] = Field(default_factory=dict)
    arguments_schema: dict[str, Any] | None = Field(
        default=None,
        description="The tool's JSON schema for its arguments, so that corrected arguments are "
        "validated by whichever channel decides (the CLI holds no agent and no tool).",
    )
    carried_out_at: float | None = Field(
        default=None,
        description="Epoch seconds when its decision was carried out: the turn parked on it "
        "went on past it (or went on without it). None: pending, or decided and left to carry "
        "out (what ``ApprovalStore.alist_to_carry_out`` lists).",
    )

    def decidable_by(self) -> tuple[Decider, ...]:
        """Who may decide: the user for a confirmation (operators too), operators otherwise."""
        return ("user", "operator") if self.kind == "user" else ("operator",)


class ApprovalStore(ABC):
    """The durable queue of approval requests, scoped by tenant in every method.

    Sync/async contract: every method is async and there are no sync twins: the queue is read
    and written from the service's event loop (a CLI runs it through `keel._bridge.run_sync`).
    """

    @abstractmethod
    async def aadd(self, request: ApprovalRequest) -> ApprovalRequest:
        """Store ``request`` unless one with its id exists; the one that stands."""

    @abstractmethod
    async def aget(self, tenant_id: str, request_id: str) -> ApprovalRequest | None:
        """The tenant's request (None: none, or another tenant's)."""

    @abstractmethod
    async def alist(
        self,
        tenant_id: str,
        *,
        user_id: str | None = None,
        session_id: str | None = None,
        statuses: Sequence[ApprovalStatus] = ("pending",),
        limit: int = 100,
    ) -> list[ApprovalRequest]:
        """The tenant's requests, oldest first; a pending one past its expiry is marked
        ``expired`` before it is listed (a parked turn goes on from an expiry too)."""

    @abstractmethod
    async def alist_to_carry_out(
        self,
        tenant_id: str,
        *,
        user_id: str | None = None,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[ApprovalRequest]:
        """The tenant's decided requests (approved, rejected, expired) not yet marked carried
        out, oldest first; ``after``: the ``(created_at, id)`` of the previous page's last
        one. A pending one past its expiry is marked ``expired`` first. Its cost follows what
        is left to carry out, never the tenant's whole history (an index holds just those)."""

    @abstractmethod
    async def atenants_to_carry_out(self, now: float | None = None) -> list[str]:
        """The tenants with decided requests not yet marked carried out, sorted; pending
        requests past their expiry at ``now`` (default: the current time) are marked
        ``expired`` first. A carrier looks at these tenants only: its cost follows what is
        left to carry out, never how many tenants or keys exist."""

    @abstractmethod
    async def amark_carried_out(
        self, tenant_id: str, request_ids: Sequence[str], now: float | None = None
    ) -> int:
        """Record that the decisions of the tenant's ``request_ids`` were carried out (their
        turn went on past them) at ``now`` (default: the current time): they leave
        `alist_to_carry_out`. Only decided requests not yet marked are; how many."""

    @abstractmethod
    async def adecide(
        self, tenant_id: str, request_id: str, status: ApprovalStatus, decision: ApprovalDecision
    ) -> tuple[ApprovalRequest, bool]:
        """Settle a pending request (compare-and-set on ``pending``): the request as it now
        stands and whether this call settled it (False: it was already settled, by this same
        decision sent again or by another one; the caller reads which from the request).

        Raises:
            KeyError: no such request for this tenant.
        """

    @abstractmethod
    async def acancel(self, tenant_id: str, session_id: str, reason: str) -> int:
        """Cancel the session's pending requests; how many."""

    @abstractmethod
    async def aexpire(self, now: float) -> int:
        """Mark pending requests past their expiry ``expired``; how many."""

    async def auser_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        """The sessions (as requests name them) the user's requests were made in: where a
        user's erasure looks for what else of theirs there is. This default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot list a user's sessions")

    async def aerase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Delete every request of ``user_id`` in ``tenant_id``, whatever its status (a user's
        erasure); ``{"approvals": removed}``. Idempotent. This default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot erase a user")
