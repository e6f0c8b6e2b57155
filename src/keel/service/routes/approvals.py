"""Approvals: the queue of tool calls (and escalated turns) waiting for a person, and deciding
one, which resumes the turn that waits on it.

An operator key sees and decides the tenant's whole queue. A user key sees and decides only
its own user's confirmations (requests of kind ``user``); any other request is 404 to it, as
another user's session is. A decision's answer is the resumed turn's reply as the key may read
it: the user's values for the user's own key, placeholders for an operator key unless the
service grants operators values.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from keel.errors import ApprovalSettledError, ToolArgumentsError
from keel.service._access import caller, read_of, user_of
from keel.service._context import ServiceContext, context_of
from keel.service._errors import HTTPError
from keel.service._ids import PLAIN_ID, RawPathRoute, Text, UserId, session_id_from_wire
from keel.service._keys import Caller
from keel.service._paging import cursor_query, limit_query, next_page, number_cursor

if TYPE_CHECKING:
    from keel.approvals import ApprovalRequest, ApprovalStatus, ApprovalStore, Channel
    from keel.runtime import AgentReply

__all__ = [
    "ApprovalVerdict",
    "approvals_of",
    "decide_as",
    "router",
    "visible_to",
]

router = APIRouter(route_class=RawPathRoute)

_STATUSES = r"^(pending|approved|rejected|expired|cancelled)$"
_STATUS_QUERY = Query(
    default=["pending"],
    description="Which requests: pending (the default), approved, rejected, expired, cancelled "
    "(repeat the parameter for several).",
)
_MOST_OWN = 10_000
"""The most requests of one user a user key's listing pages through (a user's own
confirmations are few; operator approvals in the same scope are skipped)."""


class ApprovalVerdict(BaseModel):
    """A decision about one waiting request."""

    model_config = ConfigDict(extra="forbid")

    approve: bool = Field(description="True: the call runs (once); false: it does not.")
    note: Text | None = Field(
        default=None, max_length=10_000, description="Why (shown to the model on a rejection)."
    )
    arguments: dict[str, Any] | None = Field(
        default=None,
        description="Corrected arguments the approved call runs with (validated like the model's).",
    )
    action: Literal["retry", "skip", "answer"] | None = Field(
        default=None,
        description="For an escalated turn: run the stopped call again, skip it, or give the "
        "model ``note`` as the answer.",
    )


def approvals_of(context: ServiceContext) -> ApprovalStore:
    """The service's approvals queue; 404 when it keeps none."""
    if context.approvals is None:
        raise HTTPError(404, "NotFound", "this service keeps no approvals queue")
    return context.approvals


def visible_to(who: Caller, request: ApprovalRequest) -> bool:
    """Whether ``who`` may see and decide ``request``: an operator key any of its tenant's;
    a user key its own user's confirmations only."""
    if who.operator:
        return True
    return request.kind == "user" and request.user_id == who.user_id


@router.get("/v1/approvals")
async def list_approvals(
    request: Request,
    response: Response,
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
    session: str | None = Query(default=None, min_length=1, max_length=512),
    user: Annotated[UserId | None, Query()] = None,
    status: list[str] = _STATUS_QUERY,
    limit: int = limit_query(),
    cursor: str | None = cursor_query(),
) -> list[dict[str, Any]]:
    """The tenant's approval requests, oldest first, a page at a time (``X-Next-Cursor``):
    pending ones unless ``status`` names others. An operator key lists the tenant's queue
    (``user`` and ``session`` narrow it); a user key lists its own user's confirmations."""
    store = approvals_of(context)
    statuses = _statuses(status)
    session_id = None if session is None else session_id_from_wire(session, "session")
    # A user key lists its own user's requests; naming another user is 403.
    user_id = who.user_id if user is None else user_of(who, user)
    start = number_cursor(cursor) or 0
    found = await store.alist(
        who.tenant_id,
        user_id=user_id,
        session_id=session_id,
        statuses=statuses,
        limit=start + limit + 1 if who.operator else _MOST_OWN,
    )
    shown = [item for item in found if visible_to(who, item)][start:]
    if who.operator and user_id is not None:
        read_of(who, user_id, "the approval requests")
    next_page(request, response, str(start + limit) if len(shown) > limit else None)
    return [item.model_dump(mode="json") for item in shown[:limit]]


def _statuses(values: list[str]) -> list[ApprovalStatus]:
    for value in values:
        if not re.fullmatch(_STATUSES, value):
            raise HTTPError(
                422,
                "ValidationError",
                f"status: {value!r} is not pending, approved, rejected, expired or cancelled",
            )
    return cast("list[ApprovalStatus]", values)


@router.get("/v1/approvals/{approval_id}")
async def get_approval(
    approval_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One approval request, as it stands (404: none, or not one this key may see)."""
    found = await approvals_of(context).aget(who.tenant_id, approval_id)
    if found is None or not visible_to(who, found):
        raise HTTPError(404, "NotFound", "not found")
    read_of(who, found.user_id, f"the approval request {approval_id!r}")
    return found.model_dump(mode="json")


@router.post("/v1/approvals/{approval_id}")
async def decide_approval(
    verdict: ApprovalVerdict,
    approval_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Decide a waiting request: the turn waiting on it resumes (the approved call runs once,
    a rejected one gives the model a result saying who rejected it and why), and its reply is
    the answer. The same decision sent again answers the same reply without running anything
    twice; a request already settled otherwise (another decision, a revert's cancellation,
    its expiry) is 409, its body's ``approval`` the request as it stands. A key that may not
    decide it gets 404."""
    try:
        reply = await decide_as(
            context,
            who,
            approval_id,
            verdict.approve,
            verdict.note,
            verdict.arguments,
            verdict.action,
        )
    except ApprovalSettledError as exc:
        standing = exc.request
        shown = await context.privacy.shown(who, standing.user_id, standing.model_dump(mode="json"))
        raise HTTPError(409, "ApprovalSettled", str(exc), extra={"approval": shown}) from None
    return context.counted(who.tenant_id, reply).model_dump(mode="json")


async def decide_as(
    context: ServiceContext,
    who: Caller,
    approval_id: str,
    approve: bool,
    note: str | None,
    arguments: dict[str, Any] | None,
    action: Literal["retry", "skip", "answer"] | None = None,
    *,
    channel: Channel = "http",
) -> AgentReply:
    """Decide the request as ``who`` through the tenant's agent (which resumes the waiting
    turn) and return the turn's reply as ``who`` may read the request's user's data: their
    values for the user's own key and for an operator granted values, else the reply as the
    turn stored it (placeholders: never revealed, so no value the masker would miss in
    revealed text reaches the operator); 404 when ``who`` may not see the request, 422 when
    the tool refuses the corrected arguments.

    Raises:
        ApprovalSettledError: the request was already settled otherwise.
    """
    found = await approvals_of(context).aget(who.tenant_id, approval_id)
    if found is None or not visible_to(who, found):
        raise HTTPError(404, "NotFound", "not found")
    agent = context.agent_for(who.tenant_id)
    by = f"operator:{who.key_id}" if who.operator else f"user:{who.user_id}"
    try:
        return await agent.decide(
            found.session_id,
            approval_id,
            approve=approve,
            by=by,
            note=note,
            arguments=None if arguments is None else json.dumps(arguments, ensure_ascii=False),
            user_id=who.user_id,
            action=action,
            channel=channel,
            reveal=context.privacy.reads_values(who, found.user_id),
        )
    except ToolArgumentsError as exc:
        # Corrected arguments the tool refuses are the client's to fix: nothing was decided.
        raise HTTPError(422, "ValidationError", f"arguments: {exc}") from None
