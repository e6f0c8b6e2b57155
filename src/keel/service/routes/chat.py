"""OpenAI's chat completions, answered by the tenant's agent: point the ``openai`` SDK here."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from keel.errors import KeelError
from keel.models import ModelOptions
from keel.runtime import TextDelta, TextDiscarded, ToolCallStarted, TurnFinished
from keel.service._access import chat_party
from keel.service._context import ServiceContext, context_of, limited_tenant, turn_id_of
from keel.service._errors import HTTPError, describe
from keel.service._models import ChatCompletionRequest
from keel.service._openai import (
    ChunkWriter,
    FinishReason,
    completion_body,
    conversation_turn_id,
    failed_turn,
    usage_of,
)

if TYPE_CHECKING:
    from keel.runtime import AgentEvent, AgentReply
    from keel.service._keys import Caller

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter()

# A parked turn (waiting for a confirmation, an operator, a call in doubt) is answered: its
# waiting message is the assistant's, and keel's status (in the ``keel`` field) says why.
_PARKED = frozenset({"tool_in_doubt", "awaiting_approval", "escalated"})


def _finish_reason(reply: AgentReply) -> FinishReason | None:
    """OpenAI's ``finish_reason`` for a turn's reply; None when the turn failed (answered as
    an error, never with keel's apology as the model's answer). An answer the runtime could
    not finish within its limits (``reply.truncated``) is ``length``."""
    if reply.status != "completed" and reply.status not in _PARKED:
        return None
    return "length" if reply.truncated else "stop"


@dataclass(frozen=True)
class _Turn:
    """What the route resolved for one request: who, and which turn."""

    session_id: str
    user_id: str
    turn_id: str

    @property
    def completion_id(self) -> str:
        """Derived from the turn id: known before the first chunk, the same streamed or not,
        and the same again when a resend replays the turn."""
        return f"chatcmpl-{self.turn_id}"

    def kwargs(self, options: ModelOptions | None) -> dict[str, Any]:
        """``Agent.run`` / ``Agent.stream`` arguments."""
        return {
            "session": self.session_id,
            "user": self.user_id,
            "turn_id": self.turn_id,
            "model_options": options,
        }


# A client's own instructions: keel's agent has its system prompt and operating rules, set
# where it is served; a request cannot replace or add to them (a customer could otherwise
# talk the agent out of its rules), and silently dropping them would mislead the client.
_INSTRUCTION_ROLES = frozenset({"system", "developer"})


def _refuse_instructions(body: ChatCompletionRequest) -> None:
    """400 for a request that carries a system (or developer) message."""
    for message in body.messages:
        if message.role in _INSTRUCTION_ROLES:
            raise HTTPError(
                400,
                "UnsupportedParameter",
                f"a {message.role} message: keel's agent has its own system prompt and "
                "operating rules, set where it is served (keel serve --agent or "
                "--system-prompt); send the conversation's user and assistant messages only",
                param="messages",
            )


def conversation_session_id(who: Caller, user_id: str, body: ChatCompletionRequest) -> str:
    """The session of a client that names none: derived from the key, the user and the
    conversation's first user message, so that every turn of one conversation (the client
    resends it whole) lands in the same session."""
    first = next((m.text() for m in body.messages if m.role == "user"), "")
    seed = "\x00".join((who.tenant_id, who.key_id, user_id, first))
    return "chat-" + hashlib.sha256(seed.encode()).hexdigest()[:32]


def _resolve(
    body: ChatCompletionRequest,
    session_id: str,
    user_id: str,
    idempotency_key: str | None,
) -> tuple[_Turn, str]:
    """The request's turn and the user's new message; 400 when it has none to run."""
    refused = body.unsupported()
    if refused is not None:
        raise HTTPError(400, "UnsupportedParameter", refused[1], param=refused[0])
    last = body.messages[-1]
    if last.role != "user":
        raise HTTPError(
            400,
            "NoNewMessage",
            f"the last message is the {last.role}'s: keel keeps the conversation and answers "
            "only a new user message at the end of the list",
            param="messages",
        )
    text = last.text()
    if not text:
        raise HTTPError(400, "NoNewMessage", "the last user message has no text", param="messages")
    turn_id = (
        turn_id_of(idempotency_key)
        or conversation_turn_id(session_id, user_id, body.messages)
        or f"chat-{uuid.uuid4().hex}"
    )
    return _Turn(session_id, user_id, turn_id), text


def _party(
    request: Request,
    body: ChatCompletionRequest,
    x_keel_session: str | None,
    x_keel_user: str | None,
) -> tuple[str, str]:
    """The session and the user of a chat completion (see ``chat_completions``)."""
    who: Caller = request.state.keel_caller
    metadata = body.metadata or {}
    user_id = x_keel_user or metadata.get("user_id") or body.user or who.user_id
    if not user_id:
        raise HTTPError(
            400,
            "MissingUser",
            "name the user this operator key speaks for: OpenAI's user field (or the "
            "X-Keel-User header); or use a user's key (keel keys create --tenant T --user U)",
            param="user",
        )
    _refuse_instructions(body)
    session_id = x_keel_session or metadata.get("session_id")
    if not session_id:
        session_id = conversation_session_id(who, user_id, body)
    # The session-id grammar, and a user key's own user only.
    return chat_party(request, session_id, user_id, user_from_header=x_keel_user is not None)


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
    here (``base_url`` and ``api_key`` are all it needs). keel keeps the session (its state,
    memory and context); the last message must be the user's new one.

    The user is ``X-Keel-User``, else ``metadata.user_id``, else OpenAI's ``user``, else the
    user of a user key (an operator key that names none is 400). The session is
    ``X-Keel-Session``, else ``metadata.session_id``, else derived from the key, the user and
    the conversation's first user message: a client that resends the whole conversation keeps
    one session (two conversations that open with the same words share it: name the session
    to keep them apart). A ``system`` or ``developer`` message is 400: the agent's prompt and
    rules are set where it is served, never by a request.

    A retry runs the turn once: a client that sends the whole conversation gets the same turn
    back for the same list, once the list holds an earlier answer; a list of only the newest
    message cannot be told from a user saying the same words again, so a client that sends
    only that (or retries a conversation's first message) uses ``Idempotency-Key``. A failed turn
    is OpenAI's error (502 the model failed, 504 the time limit, 500 another limit), before
    the first byte with its status, after it as an error event the SDK raises."""
    session_id, user_id = _party(request, body, x_keel_session, x_keel_user)
    turn, text = _resolve(body, session_id, user_id, idempotency_key)
    agent = context.agent_for(tenant_id)
    requested = body.model_options()
    options = agent.model_options.model_copy(update=requested) if requested else None
    if not body.stream:
        created = int(time.time())
        reply = context.counted(tenant_id, await agent.run(text, **turn.kwargs(options)))
        reason = _finish_reason(reply)
        if reason is None:
            raise failed_turn(reply)
        usage = await usage_of(context.traces, reply)
        return completion_body(turn.completion_id, body, reply, reason, usage, created)
    events = aiter(agent.stream(text, **turn.kwargs(options)))
    opening = await _opening(events, context, tenant_id)
    writer = ChunkWriter(
        turn.completion_id,
        body.model,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
    chunks = _chunks(writer, opening, events, context, tenant_id)
    return StreamingResponse(chunks, media_type="text/event-stream")


async def _opening(
    events: AsyncIterator[AgentEvent], context: ServiceContext, tenant_id: str
) -> list[AgentEvent]:
    """The turn's events up to its first text or its end, read before the response starts:
    what fails until then (a busy session, a store, the turn itself) is the HTTP status."""
    held: list[AgentEvent] = []
    try:
        while not held or not isinstance(held[-1], TextDelta | TurnFinished):
            held.append(await anext(events))
    except BaseException:
        await _close(events)
        raise
    last = held[-1]
    if isinstance(last, TurnFinished) and _finish_reason(last.reply) is None:
        await _close(events)
        raise failed_turn(context.counted(tenant_id, last.reply))
    return held


async def _close(events: AsyncIterator[AgentEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def _replayed(
    opening: list[AgentEvent], events: AsyncIterator[AgentEvent]
) -> AsyncIterator[AgentEvent]:
    for event in opening:
        yield event
    async for event in events:
        yield event


class _Shown:
    """The text the client was sent for the answer being written: each step's since the
    last tool call (what came before stays on the client's screen, as the model's words)."""

    def __init__(self) -> None:
        self.by_step: dict[int, str] = {}
        self.withdrawn = False
        """Text of the answer was sent and then discarded (the model was asked again)."""

    def see(self, event: AgentEvent) -> None:
        if isinstance(event, TextDelta):
            self.by_step[event.step] = self.by_step.get(event.step, "") + event.text
        elif isinstance(event, ToolCallStarted):
            self.by_step.clear()
        elif isinstance(event, TextDiscarded) and self.by_step.pop(event.step, ""):
            self.withdrawn = True

    def rest_of(self, answer: str) -> str | None:
        """What of ``answer`` is still to send; None when what was sent is not its start."""
        sent = "".join(self.by_step.values())
        if self.withdrawn or not answer.startswith(sent):
            return None
        return answer[len(sent) :]


async def _chunks(
    writer: ChunkWriter,
    opening: list[AgentEvent],
    events: AsyncIterator[AgentEvent],
    context: ServiceContext,
    tenant_id: str,
) -> AsyncIterator[bytes]:
    """The completion's chunks: the text as it comes, then the finish (or an error event)."""
    yield writer.chunk({"role": "assistant", "content": ""})
    shown = _Shown()
    try:
        async for event in _replayed(opening, events):
            shown.see(event)
            if isinstance(event, TextDelta):
                yield writer.chunk({"content": event.text})
            elif isinstance(event, TurnFinished):
                reply = context.counted(tenant_id, event.reply)
                async for chunk in _finish(writer, reply, shown, context):
                    yield chunk
    except KeelError as exc:
        yield writer.error(*describe(exc))
    except Exception:
        logger.exception("a streamed completion failed after its first chunk")
        yield writer.error(500, "InternalError", "the turn failed; the server's log says why")
    finally:
        await _close(events)


async def _finish(
    writer: ChunkWriter, reply: AgentReply, shown: _Shown, context: ServiceContext
) -> AsyncIterator[bytes]:
    """The end of a streamed completion: the rest of the answer and its finish reason, or
    the failed turn's error (the text streamed so far was not an answer)."""
    reason = _finish_reason(reply)
    if reason is None:
        error = failed_turn(reply)
        yield writer.error(error.status, error.kind, error.message)
        return
    rest = shown.rest_of(reply.text)
    if rest is None:
        # An event stream cannot take text back: the answer is committed, and readable.
        yield writer.error(
            502,
            "StreamWithdrawn",
            "text streamed for this answer was withdrawn when the model was asked again; the "
            f"answer is committed in run {reply.run_id} (GET /v1/runs/{reply.run_id})",
        )
        return
    if rest:
        yield writer.chunk({"content": rest})
    yield writer.chunk({}, reason, keel=reply.model_dump(mode="json"))
    if writer.include_usage:
        yield writer.usage(await usage_of(context.traces, reply))
    yield b"data: [DONE]\n\n"
