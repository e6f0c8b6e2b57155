"""Long-term memory of a tenant's users: search, add, forget."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query

from keel.memory import Scope
from keel.service._context import ServiceContext, context_of, limited_tenant, memory_of
from keel.service._errors import HTTPError
from keel.service._models import MemoryAddition

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/memory/search")
async def search_memory(
    user: str = Query(min_length=1, max_length=256),
    q: str = Query(min_length=1, max_length=2_000),
    k: int = Query(default=10, ge=1, le=100),
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> list[dict[str, Any]]:
    """The user's most relevant memories for ``q``, with why each ranked."""
    memory = memory_of(context.agent_for(tenant_id))
    hits = await memory.asearch(q, scope=Scope(tenant_id=tenant_id, user_id=user), k=k)
    return [
        {
            "record": hit.record.model_dump(mode="json", exclude={"embedding"}),
            "score": hit.score,
            "keyword_rank": hit.keyword_rank,
            "vector_rank": hit.vector_rank,
            "similarity": hit.similarity,
            "recency_boost": hit.recency_boost,
        }
        for hit in hits
    ]


@router.post("/v1/memory", status_code=201)
async def add_memory(
    record: MemoryAddition,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Remember a note for the user (masked before it is stored; a user claim)."""
    memory = memory_of(context.agent_for(tenant_id))
    added = await memory.aadd(
        record.text, scope=Scope(tenant_id=tenant_id, user_id=record.user), kind=record.kind
    )
    return added.model_dump(mode="json", exclude={"embedding"})


@router.delete("/v1/memory/{record_id}")
async def forget_memory(
    record_id: str,
    user: str = Query(min_length=1, max_length=256),
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Forget one of the user's memories (404 when the user has no such record)."""
    memory = memory_of(context.agent_for(tenant_id))
    scope = Scope(tenant_id=tenant_id, user_id=user)
    if not await asyncio.to_thread(memory.forget, scope, record_id):
        raise HTTPError(404, "NotFound", "not found")
    return {"forgotten": record_id}
