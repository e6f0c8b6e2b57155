"""Runs: the traces of a tenant's turns."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from keel.service._context import ServiceContext, context_of, limited_tenant
from keel.service._errors import HTTPError
from keel.tracing import RunQuery, RunStatus

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/runs")
async def list_runs(
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
    session: str | None = None,
    status: RunStatus | None = None,
    limit: int = Query(default=50, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """The tenant's runs, newest first (``session``, ``status`` filters)."""
    query = RunQuery(tenant_id=tenant_id, session_id=session, status=status, limit=limit)
    return [run.model_dump(mode="json") for run in context.traces.list_runs(query)]


@router.get("/v1/runs/{run_id}")
async def get_run(
    run_id: str,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One run with its steps."""
    detail = context.traces.get_run_detail(run_id)
    if detail is None or detail.run.tenant_id != tenant_id:
        raise HTTPError(404, "NotFound", "not found")
    return detail.model_dump(mode="json")
