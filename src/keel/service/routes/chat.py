"""OpenAI's chat completions, answered by the tenant's agent: point the ``openai`` SDK here."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from keel.errors import KeelError
from keel.runtime import TextDelta, TurnFinished
from keel.service._access import chat_party
from keel.service._context import ServiceContext, context_of, limited_tenant, turn_id_of
from keel.service._errors import HTTPError
from keel.service._models import ChatCompletionRequest

if TYPE_CHECKING:
    from keel.runtime import Agent, AgentReply

__all__ = ["router"]

router = APIRouter()


def _completion(
    body: ChatCompletionRequest, reply: AgentReply, created: int, context: ServiceContext
) -> dict[str, Any]:
    run = context.traces.get_run(reply.run_id)
    prompt = run.prompt_tokens if run is not None else 0
    completion = run.completion_tokens if run is not None else 0
    return {
        "id": f"chatcmpl-{reply.run_id}",
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.text},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "keel": reply.model_dump(mode="json"),
    }


def _chunks(
    agent: Agent,
    body: ChatCompletionRequest,
    text: str,
    *,
    session_id: str,
    user_id: str,
    turn_id: str | None,
    tenant_id: str,
    context: ServiceContext,
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None, completion_id: str) -> bytes:
        payload = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def chunks() -> AsyncIterator[bytes]:
        completion_id = f"chatcmpl-{hashlib.sha256(os.urandom(16)).hexdigest()[:24]}"
        yield chunk({"role": "assistant", "content": ""}, None, completion_id)
        shown = ""
        try:
            async for event in agent.stream(
                text, session=session_id, user=user_id, turn_id=turn_id
            ):
                if isinstance(event, TextDelta):
                    shown += event.text
                    yield chunk({"content": event.text}, None, completion_id)
                elif isinstance(event, TurnFinished):
                    context.counted(tenant_id, event.reply)
                    # The reply is authoritative: what it adds to the text shown, if the
                    # streamed attempt was withdrawn or the turn ended with a message.
                    rest = event.reply.text
                    if rest.startswith(shown):
                        rest = rest[len(shown) :]
                    elif shown:
                        rest = "\n" + rest
                    if rest:
                        yield chunk({"content": rest}, None, completion_id)
        except KeelError as exc:
            error = {"error": {"type": type(exc).__name__, "message": str(exc)}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            return
        yield chunk({}, "stop", completion_id)
        yield b"data: [DONE]\n\n"

    return chunks()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    tenant_id: str = Depends(limited_tenant),
    context: ServiceContext = Depends(context_of),
    x_keel_session: str | None = Header(default=None, max_length=256),
    x_keel_user: str | None = Header(default=None, max_length=256),
    idempotency_key: str | None = Header(default=None, max_length=255),
) -> Any:
    """OpenAI's chat completions, answered by the tenant's agent: point the ``openai`` SDK
    here. keel keeps the session (its state, memory and context): send only the newest
    message. The session and user come from ``X-Keel-Session`` / ``X-Keel-User``, else
    from ``metadata`` (``session_id``, ``user_id``), the user also from ``user``."""
    metadata = body.metadata or {}
    session_id = x_keel_session or metadata.get("session_id")
    user_id = x_keel_user or metadata.get("user_id") or body.user
    if not session_id or not user_id:
        raise HTTPError(
            422,
            "ValidationError",
            "name the session and the user: X-Keel-Session and X-Keel-User headers, or "
            "metadata.session_id and metadata.user_id",
        )
    session_id, user_id = chat_party(
        request, session_id, user_id, user_from_header=x_keel_user is not None
    )
    text = body.newest_user_text()
    if text is None:
        raise HTTPError(422, "ValidationError", "messages hold no user message with text")
    agent = context.agent_for(tenant_id)
    turn_id = turn_id_of(idempotency_key)
    if not body.stream:
        created = int(time.time())
        reply = await agent.run(text, session=session_id, user=user_id, turn_id=turn_id)
        return _completion(body, context.counted(tenant_id, reply), created, context)
    chunks = _chunks(
        agent,
        body,
        text,
        session_id=session_id,
        user_id=user_id,
        turn_id=turn_id,
        tenant_id=tenant_id,
        context=context,
    )
    return StreamingResponse(chunks, media_type="text/event-stream")
