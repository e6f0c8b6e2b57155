"""Turns: one user message for a session, answered whole or as server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from keel.errors import KeelError
from keel.runtime import TextDiscarded, TurnFinished
from keel.service._access import caller, path_session_id, user_of
from keel.service._context import ServiceContext, context_of, turn_id_of
from keel.service._errors import STORE_UNAVAILABLE, error_status
from keel.service._ids import RawPathRoute
from keel.service._keys import Caller
from keel.service._models import TurnRequest

__all__ = ["router"]

router = APIRouter(route_class=RawPathRoute)


@router.post("/v1/sessions/{session_id}/turns", response_model=None)
async def post_turn(
    turn: TurnRequest,
    request: Request,
    session_id: str = Depends(path_session_id),
    who: Caller = Depends(caller),
    context: ServiceContext = Depends(context_of),
    idempotency_key: str | None = Header(default=None, max_length=255),
) -> Any:
    """Send one user message. ``Accept: text/event-stream`` streams the turn's events
    (server-sent events, one JSON event each, the reply last); otherwise the reply.

    With an ``Idempotency-Key``, sending the same request again (after a timeout, a dead
    worker) runs the turn once: a committed turn's reply comes back (``replayed``), a turn
    left open is finished. The same key with another message is 422."""
    tenant_id, user_id = who.tenant_id, user_of(who, turn.user or who.user_id)
    agent = context.agent_for(tenant_id)
    turn_id = turn_id_of(idempotency_key)
    if "text/event-stream" not in request.headers.get("accept", ""):
        reply = await agent.run(turn.message, session=session_id, user=user_id, turn_id=turn_id)
        return context.counted(tenant_id, reply).model_dump(mode="json")

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in agent.stream(
                turn.message, session=session_id, user=user_id, turn_id=turn_id
            ):
                if isinstance(event, TurnFinished):
                    event = event.model_copy(
                        update={"reply": context.counted(tenant_id, event.reply)}
                    )
                elif isinstance(event, TextDiscarded):  # its reason may be the model's error
                    event = event.model_copy(
                        update={"reason": context.told(tenant_id, event.reason)}
                    )
                payload = event.model_dump_json()
                yield f"event: {event.type}\ndata: {payload}\n\n".encode()
        except KeelError as exc:
            status = error_status(exc)
            message = STORE_UNAVAILABLE if status == 503 else str(exc)
            body = json.dumps({"type": type(exc).__name__, "message": message, "status": status})
            yield f"event: error\ndata: {body}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")
