"""Sessions: their committed state, checkpoint history and revert."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from keel.errors import StateError
from keel.service._context import ServiceContext, context_of, limited_tenant
from keel.service._errors import HTTPError
from keel.service._models import RevertRequest

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sessions/{session_id}")
async def get_session(
    session_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """The session's committed state and version."""
    agent = context.agent_for(tenant_id)
    checkpoint = await agent.state.aget(agent.session_key(session_id))
    if checkpoint is None:
        raise HTTPError(404, "NotFound", "not found")
    return {
        "session_id": session_id,
        "version": checkpoint.version,
        "state": checkpoint.state.model_dump(mode="json"),
    }


@router.get("/v1/sessions/{session_id}/checkpoints")
async def get_checkpoints(
    session_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
    limit: int = Query(default=50, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """The session's checkpoint history, newest first."""
    agent = context.agent_for(tenant_id)
    history = await agent.state.ahistory(agent.session_key(session_id), limit=limit)
    if not history:
        raise HTTPError(404, "NotFound", "not found")
    return [info.model_dump(mode="json", exclude={"session_id"}) for info in history]


@router.post("/v1/sessions/{session_id}/revert")
async def revert_session(
    session_id: str,
    revert: RevertRequest,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Put the session back to an earlier version, as a new version: compare-and-set on
    ``expected_version`` (409 when another writer moved the session since)."""
    agent = context.agent_for(tenant_id)
    key = agent.session_key(session_id)
    if await agent.state.aget(key) is None:
        raise HTTPError(404, "NotFound", "not found")
    try:
        checkpoint = await agent.state.arevert(
            key, expected_version=revert.expected_version, to_version=revert.version
        )
    except StateError as exc:
        raise HTTPError(404, "NotFound", str(exc)) from None
    return {"session_id": session_id, "version": checkpoint.version}
