"""Sessions: their committed state, checkpoint history and revert.

A session id in a path is spelled as `keel.service._ids` says (percent-encoded UTF-8
beyond ``A-Z a-z 0-9 - . _ ~ : @``), so every session an agent holds has a URL."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from keel.errors import StateError
from keel.service._access import (
    caller,
    owned_checkpoint,
    path_session_id,
    revert_holding_lease,
)
from keel.service._context import ServiceContext, context_of
from keel.service._errors import HTTPError
from keel.service._ids import RawPathRoute
from keel.service._keys import Caller
from keel.service._models import RevertRequest
from keel.service._paging import cursor_query, limit_query, next_page, number_cursor

__all__ = ["router"]

router = APIRouter(route_class=RawPathRoute)


@router.get("/v1/sessions/{session_id}")
async def get_session(
    session_id: str = Depends(path_session_id),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """The session's committed state and version (with a PII vault: its user's values to
    the user's key, placeholders to an operator key unless the service grants it values)."""
    agent = context.agent_for(who.tenant_id)
    checkpoint = await owned_checkpoint(agent, who, session_id, "the state")
    owner = checkpoint.state.runtime.user_id
    return {
        "session_id": session_id,
        "version": checkpoint.version,
        "state": await context.privacy.shown(who, owner, checkpoint.state.model_dump(mode="json")),
    }


@router.get("/v1/sessions/{session_id}/checkpoints")
async def get_checkpoints(
    request: Request,
    response: Response,
    session_id: str = Depends(path_session_id),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
    limit: int = limit_query(),
    cursor: str | None = cursor_query(),
) -> list[dict[str, Any]]:
    """The session's checkpoint history, newest first, a page at a time (``X-Next-Cursor``)."""
    agent = context.agent_for(who.tenant_id)
    await owned_checkpoint(agent, who, session_id, "the checkpoints")
    history = await agent.state.ahistory(agent.session_key(session_id))
    before = number_cursor(cursor)
    if before is not None:
        history = [info for info in history if info.version < before]
    page = history[:limit]
    next_page(request, response, str(page[-1].version) if len(history) > limit else None)
    return [info.model_dump(mode="json", exclude={"session_id"}) for info in page]


@router.post("/v1/sessions/{session_id}/revert")
async def revert_session(
    revert: RevertRequest,
    session_id: str = Depends(path_session_id),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Put the session back to an earlier version, as a new version: compare-and-set on
    ``expected_version`` (409 when another writer moved the session since). A revert holds
    the session's lease as a turn does: while a turn runs, 409 busy, and nothing changes."""
    agent = context.agent_for(who.tenant_id)
    await owned_checkpoint(agent, who, session_id, "the state")
    try:
        checkpoint = await revert_holding_lease(
            agent, session_id, expected_version=revert.expected_version, to_version=revert.version
        )
    except StateError as exc:
        raise HTTPError(404, "NotFound", str(exc)) from None
    return {"session_id": session_id, "version": checkpoint.version}
