"""OpenAI's model list: the agent the tenant's chat completions are answered by."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends

from keel.service._context import ServiceContext, context_of, limited_tenant
from keel.service._errors import HTTPError

if TYPE_CHECKING:
    from keel.runtime import Agent

__all__ = ["router"]

router = APIRouter()


def _model(agent: Agent) -> dict[str, Any]:
    # OpenAI's model object; an agent has no creation date, so ``created`` is 0.
    return {"id": agent.name, "object": "model", "created": 0, "owned_by": "keel"}


@router.get("/v1/models")
async def list_models(
    tenant_id: str = Depends(limited_tenant), context: ServiceContext = Depends(context_of)
) -> dict[str, Any]:
    """OpenAI's model list: the tenant's agent, which answers ``/v1/chat/completions``
    whatever ``model`` a request names (the name is echoed in the completion)."""
    return {"object": "list", "data": [_model(context.agent_for(tenant_id))]}


@router.get("/v1/models/{model_id}")
async def retrieve_model(
    model_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One model of the list; 404 for another name."""
    agent = context.agent_for(tenant_id)
    if model_id != agent.name:
        raise HTTPError(404, "ModelNotFound", f"no model {model_id!r}; GET /v1/models lists them")
    return _model(agent)
