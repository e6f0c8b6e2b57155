"""Tool calls left in doubt: listing a session's, and an operator's verdict on one."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends

from keel.service._context import ServiceContext, context_of, journal_of, limited_tenant
from keel.service._errors import HTTPError
from keel.service._models import Resolution

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sessions/{session_id}/in-doubt")
async def session_in_doubt(
    session_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> list[dict[str, Any]]:
    """Side-effecting calls of the session that started and recorded no result."""
    agent = context.agent_for(tenant_id)
    journal = journal_of(agent)
    entries = await asyncio.to_thread(journal.in_doubt, agent.session_key(session_id))
    return [entry.model_dump(mode="json", exclude={"session_id"}) for entry in entries]


@router.post("/v1/tools/in-doubt/{key}/resolve")
async def resolve_in_doubt(
    key: str,
    resolution: Resolution,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """An operator's verdict on an in-doubt call: what really happened. A resumed turn then
    tells the model that, instead of running the tool again."""
    agent = context.agent_for(tenant_id)
    journal = journal_of(agent)
    entry = await journal.aget(key)
    # A journal entry's session is a tenant-scoped session key ("tenant/session").
    scope = agent.session_key("x")[: -len("x")]
    if entry is None or not entry.session_id.startswith(scope) or not entry.in_doubt:
        raise HTTPError(404, "NotFound", "not found")
    resolved = await asyncio.to_thread(
        journal.resolve, key, ok=resolution.ok, content=resolution.content
    )
    return resolved.model_dump(mode="json", exclude={"session_id"})
