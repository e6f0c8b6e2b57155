"""Long-term memory of a tenant's users: search, add, forget."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from keel._bridge import run_blocking
from keel.memory import Memory, Scope
from keel.service._access import caller, read_of, user_of
from keel.service._context import ServiceContext, context_of, memory_of
from keel.service._errors import HTTPError
from keel.service._ids import PLAIN_ID, Text, UserId
from keel.service._keys import Caller
from keel.service._models import MemoryAddition
from keel.service._paging import clip

__all__ = ["router"]

router = APIRouter()


def _users_memory(
    who: Caller, context: ServiceContext, user: str, *, read: bool
) -> tuple[Memory, Scope]:
    """The tenant's memory and the user's scope in it, once the key may act for the user
    (and, to ``read``, see what the user's memory holds: an operator's read is logged)."""
    memory = memory_of(context.agent_for(who.tenant_id))
    user = user_of(who, user)
    if read:
        read_of(who, user, "the memory")
    return memory, Scope(tenant_id=who.tenant_id, user_id=user)


@router.get("/v1/memory/search")
async def search_memory(
    user: Annotated[UserId, Query()],
    q: Annotated[Text, Query(min_length=1, max_length=2_000)],
    k: int = Query(default=10, ge=1, le=100),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> list[dict[str, Any]]:
    """The user's most relevant memories for ``q``, with why each ranked; a long text is
    clipped (``"clipped": true``), whole at ``GET /v1/memory/{id}``."""
    memory, scope = _users_memory(who, context, user, read=True)
    hits = await memory.asearch(q, scope=scope, k=k)
    found = [
        {
            "record": clip(hit.record.model_dump(mode="json", exclude={"embedding"}), "text"),
            "score": hit.score,
            "keyword_rank": hit.keyword_rank,
            "vector_rank": hit.vector_rank,
            "similarity": hit.similarity,
            "recency_boost": hit.recency_boost,
        }
        for hit in hits
    ]
    return await context.privacy.shown(who, scope.user_id, found)


@router.get("/v1/memory/{record_id}")
async def get_memory(
    user: Annotated[UserId, Query()],
    record_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One of the user's memories, its text whole (404 when the user has no such record)."""
    memory, scope = _users_memory(who, context, user, read=True)
    found = await run_blocking(memory.get, scope, record_id)
    if found is None:
        raise HTTPError(404, "NotFound", "not found")
    return await context.privacy.shown(
        who, scope.user_id, found.model_dump(mode="json", exclude={"embedding"})
    )


@router.post("/v1/memory", status_code=201)
async def add_memory(
    record: MemoryAddition,
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Remember a note for the user (masked before it is stored, with the user's own
    placeholders when the service keeps a PII vault; a user claim)."""
    memory, scope = _users_memory(who, context, record.user, read=False)
    # Memory masks through the user's vault (the service's, as the agent's memory has it).
    added = await memory.aadd(record.text, scope=scope, kind=record.kind)
    return await context.privacy.shown(
        who, scope.user_id, added.model_dump(mode="json", exclude={"embedding"})
    )


@router.delete("/v1/memory/{record_id}")
async def forget_memory(
    user: Annotated[UserId, Query()],
    record_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """Forget one of the user's memories (404 when the user has no such record)."""
    memory, scope = _users_memory(who, context, user, read=False)
    if not await run_blocking(memory.forget, scope, record_id):
        raise HTTPError(404, "NotFound", "not found")
    return {"forgotten": record_id}
