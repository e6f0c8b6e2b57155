"""Tool calls left in doubt: listing a session's, and an operator's verdict on one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Request, Response

from keel._bridge import run_blocking
from keel.service._access import caller, path_session_id, read_of, session_read
from keel.service._context import ServiceContext, context_of, journal_of
from keel.service._errors import HTTPError
from keel.service._ids import PLAIN_ID, RawPathRoute
from keel.service._keys import Caller
from keel.service._models import Resolution
from keel.service._paging import cursor_query, limit_query, next_page, number_cursor

__all__ = ["router"]

router = APIRouter(route_class=RawPathRoute)


@router.get("/v1/sessions/{session_id}/in-doubt")
async def session_in_doubt(
    request: Request,
    response: Response,
    session_id: str = Depends(path_session_id),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
    limit: int = limit_query(),
    cursor: str | None = cursor_query(),
) -> list[dict[str, Any]]:
    """Side-effecting calls of the session that started and recorded no result, oldest
    first, a page at a time (``X-Next-Cursor``)."""
    agent = context.agent_for(who.tenant_id)
    journal = journal_of(agent)
    checkpoint = await session_read(agent, who, session_id, "the in-doubt calls")
    entries = await run_blocking(journal.in_doubt, agent.session_key(session_id))
    start = number_cursor(cursor) or 0
    entries = entries[start:]
    page = entries[:limit]
    next_page(request, response, str(start + limit) if len(entries) > limit else None)
    owner = None if checkpoint is None else checkpoint.state.runtime.user_id
    listed = [entry.model_dump(mode="json", exclude={"session_id"}) for entry in page]
    return await context.privacy.shown(who, owner, listed)


@router.post("/v1/tools/in-doubt/{key}/resolve")
async def resolve_in_doubt(
    resolution: Resolution,
    key: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """An operator's verdict on an in-doubt call: what really happened. A resumed turn then
    tells the model that, instead of running the tool again."""
    agent = context.agent_for(who.tenant_id)
    journal = journal_of(agent)
    entry = await journal.aget(key)
    # A journal entry's session is a tenant-scoped session key ("tenant/session").
    scope = agent.session_key("x")[: -len("x")]
    if entry is None or not entry.session_id.startswith(scope) or not entry.in_doubt:
        raise HTTPError(404, "NotFound", "not found")
    session = await agent.state.aget(entry.session_id)
    owner = None if session is None else session.state.runtime.user_id
    read_of(who, owner, f"the in-doubt call {key!r}")
    resolved = await run_blocking(
        journal.resolve, key, ok=resolution.ok, content=resolution.content
    )
    return resolved.model_dump(mode="json", exclude={"session_id"})
