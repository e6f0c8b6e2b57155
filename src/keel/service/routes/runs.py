"""Runs: the traces of a tenant's turns."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from keel.service._access import access_log, caller, read_of
from keel.service._context import ServiceContext, context_of
from keel.service._errors import HTTPError
from keel.service._ids import PLAIN_ID, check_user_id
from keel.service._keys import Caller
from keel.service._paging import bad_cursor, clip, cursor_query, limit_query, next_page
from keel.tracing import Run, RunQuery, RunStatus

__all__ = ["router"]

router = APIRouter()

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_CURSOR = re.compile(r"(\d{1,20})\.([A-Za-z0-9_-]{1,128})")
_TIES = 32
"""Runs that may share the page boundary's start time and still be read past."""


def _position(run: Run) -> tuple[int, str]:
    """Where a run stands in the newest-first order: its start (in microseconds), its id."""
    return (run.started_at - _EPOCH) // _MICROSECOND, run.run_id


def _session_filter(session: str | None) -> str | None:
    if session is None:
        return None
    try:
        return check_user_id(session)
    except ValueError:
        raise HTTPError(422, "ValidationError", "session: non-blank printable text") from None


@router.get("/v1/runs")
async def list_runs(
    request: Request,
    response: Response,
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
    session: str | None = Query(default=None, max_length=256),
    status: RunStatus | None = None,
    limit: int = limit_query(),
    cursor: str | None = cursor_query(),
) -> list[dict[str, Any]]:
    """The tenant's runs (a user key: its user's), newest first, a page at a time
    (``X-Next-Cursor``); inputs and outputs clipped (the run's own route has them whole)."""
    found = _CURSOR.fullmatch(cursor) if cursor is not None else None
    if cursor is not None and found is None:
        raise bad_cursor()
    after = None if found is None else (int(found[1]), found[2])
    query = RunQuery(
        tenant_id=who.tenant_id,
        user_id=who.user_id,
        session_id=_session_filter(session),
        status=status,
        until=None if after is None else _EPOCH + (after[0] + 1) * _MICROSECOND,
        limit=limit + 1 + (_TIES if after is not None else 0),
    )
    runs = [
        run for run in context.traces.list_runs(query) if after is None or _position(run) < after
    ]
    page = runs[:limit]
    last = _position(page[-1]) if page else None
    next_page(request, response, f"{last[0]}.{last[1]}" if last and len(runs) > limit else None)
    if who.operator:
        access_log.info(
            "operator key %s listed the runs of tenant %s", who.key_id, who.tenant_id,
            extra={"tenant": who.tenant_id, "key_id": who.key_id, "read": "runs"},
        )  # fmt: skip
    # The model server's address (in a failed run's error) is the deployment's, not the
    # tenant's: named "the model server", as in a turn's reply.
    return [
        await context.privacy.shown(
            who,
            run.user_id,
            clip(
                context.told_all(who.tenant_id, run.model_dump(mode="json")),
                "input",
                "output",
                "error_message",
            ),
        )
        for run in page
    ]


@router.get("/v1/runs/{run_id}")
async def get_run(
    run_id: str = Path(min_length=1, max_length=256, pattern=PLAIN_ID),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
) -> dict[str, Any]:
    """One run with its steps, its input and output whole (with a PII vault: values or
    placeholders as for the session's state)."""
    detail = context.traces.get_run_detail(run_id)
    if detail is None or detail.run.tenant_id != who.tenant_id:
        raise HTTPError(404, "NotFound", "not found")
    read_of(who, detail.run.user_id, f"the run {run_id!r}")
    shown = context.told_all(who.tenant_id, detail.model_dump(mode="json"))
    return await context.privacy.shown(who, detail.run.user_id, shown)
