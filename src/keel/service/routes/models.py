"""OpenAI's model list: the agent the tenant's chat completions are answered by."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from keel.service._context import ServiceContext, context_of, limited_tenant
from keel.service._errors import HTTPError

__all__ = ["router"]

router = APIRouter()


MODEL_ID = "keel"
"""The model id the tenant's agent is listed under (what the docs' clients send)."""


def _model(model_id: str = MODEL_ID) -> dict[str, Any]:
    # OpenAI's model object; an agent has no creation date, so ``created`` is 0.
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "keel"}


@router.get("/v1/models")
async def list_models(
    tenant_id: str = Depends(limited_tenant), context: ServiceContext = Depends(context_of)
) -> dict[str, Any]:
    """OpenAI's model list: ``keel``, the tenant's agent, which answers
    ``/v1/chat/completions`` whatever ``model`` a request names (the name is echoed in the
    completion)."""
    return {"object": "list", "data": [_model()]}


@router.get("/v1/models/{model_id}")
async def retrieve_model(
    model_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One model of the list (``keel``; the agent's name is an alias); 404 for another."""
    if model_id not in (MODEL_ID, context.agent_for(tenant_id).name):
        raise HTTPError(404, "ModelNotFound", f"no model {model_id!r}; GET /v1/models lists them")
    return _model(model_id)
