"""The viewer's approvals page: the tenant's pending queue, and a form per request to approve
(optionally with corrected arguments) or reject it. A decision goes through the tenant's agent,
as ``POST /v1/approvals/{id}`` does: under ``keel serve --agent`` the waiting turn resumes, and
its answer is shown as the operator's key reads it (placeholders, unless the service grants
operators values). The standalone ``keel ui``, whose agent has none of the application's tools,
records the decision (channel ``viewer``), as the command line does, and leaves the turn to the
application's carrier. A decision that did not take effect says so, with the outcome that
stands."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Form, Path, Request
from fastapi.responses import Response

from keel.errors import KeelError
from keel.service._context import context_of
from keel.service._errors import HTTPError
from keel.service._ids import PLAIN_ID, RawPathRoute, Text
from keel.service._keys import Caller
from keel.service.routes.approvals import decide_as
from keel.ui._viewer import Missing, Viewer, current_viewer, signed_in, signed_in_tenant

__all__ = ["router"]

router = APIRouter(include_in_schema=False, route_class=RawPathRoute)

_SHOWN = 200
_ACTIONS: dict[str, Literal["retry", "skip", "answer"]] = {
    "retry": "retry",
    "skip": "skip",
    "answer": "answer",
}
"""An escalation's answers, as the form spells them."""


async def _queue_page(
    request: Request, viewer: Viewer, tenant: str, *, notice: str | None = None
) -> Response:
    context = context_of(request)
    enabled = context.approvals is not None
    pending = []
    if context.approvals is not None:
        pending = await context.approvals.alist(tenant, limit=_SHOWN)
    return viewer.page(
        "approvals.html", request, tenant=tenant, enabled=enabled, pending=pending, notice=notice
    )


@router.get("/ui/approvals")
async def approvals(
    request: Request,
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    return await _queue_page(request, viewer, tenant)


def _corrected(arguments: str) -> dict[str, Any] | None:
    """The form's corrected arguments: none when left empty; a JSON object otherwise."""
    if not arguments.strip():
        return None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError("The corrected arguments must be a JSON object: nothing was decided.")
    return value


@router.post("/ui/approvals/{approval_id}")
async def decide(
    request: Request,
    approval_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    verdict: str = Form(pattern=r"^(approve|reject)$"),
    note: Text = Form("", max_length=10_000),  # noqa: B008 - FastAPI form field
    arguments: str = Form("", max_length=100_000),
    action: str = Form("", pattern=r"^(|retry|skip|answer)$"),
    who: Caller = Depends(signed_in),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    # The viewer signs in with the tenant's operator key only; the decider is that key.
    tenant = who.tenant_id
    approve = verdict == "approve"
    try:
        corrected = _corrected(arguments) if approve else None
        reply = await decide_as(
            context_of(request),
            who,
            approval_id,
            approve,
            note or None,
            corrected,
            _ACTIONS.get(action),
            channel="viewer",
        )
    except ValueError as exc:
        return await _queue_page(request, viewer, tenant, notice=str(exc))
    except HTTPError:
        raise Missing from None
    except KeelError as exc:
        notice = f"{approval_id} was not decided: {exc}"
        return await _queue_page(request, viewer, tenant, notice=notice)
    done = "Approved" if approve else "Rejected"
    if not reply.run_id:
        # Recorded only (this viewer's agent lacks the tool): the application carries it out.
        notice = f"{done} {approval_id}. {reply.text[:300]}"
    else:
        notice = f"{done} {approval_id}; the turn resumed ({reply.status}): {reply.text[:300]}"
    return await _queue_page(request, viewer, tenant, notice=notice)
