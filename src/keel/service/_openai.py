"""The OpenAI facade's shapes: a turn's reply as a chat completion (whole or in chunks), a
failed turn as OpenAI's error, and the turn id a conversation's resend shares."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from keel.service._errors import HTTPError, openai_error

if TYPE_CHECKING:
    from keel.runtime import AgentReply
    from keel.service._models import ChatCompletionRequest, ChatMessage
    from keel.tracing import TraceStore

__all__ = [
    "ChunkWriter",
    "FinishReason",
    "completion_body",
    "conversation_turn_id",
    "failed_turn",
    "usage_of",
]

FinishReason = Literal["stop", "length"]
"""OpenAI's ``finish_reason`` of an answered turn."""

# A failed turn's HTTP status: the model's failure is a bad gateway, the time limit a timeout.
_FAILED_STATUS = {"model_failed": 502, "invalid_output": 502, "time_limit": 504}


def failed_turn(reply: AgentReply) -> HTTPError:
    """A failed turn as the error the request answers: OpenAI's body, keel's reply beside it
    (its status, run and error; ``keel runs show RUN`` has the rest)."""
    status = _FAILED_STATUS.get(reply.status, 500)
    message = f"the agent could not answer ({reply.status}; run {reply.run_id})"
    if reply.error:
        message = f"{message}: {reply.error}"
    return HTTPError(status, reply.status, message, extra={"keel": reply.model_dump(mode="json")})


def conversation_turn_id(session_id: str, user_id: str, messages: list[ChatMessage]) -> str | None:
    """The turn id of a request that sends the whole conversation: the same for a resend,
    so it is the same turn. None for a list with no earlier answer in it (the client sends
    only the newest message, or this is the first turn): that cannot be told from the user
    saying the same words again, and such a client retries with ``Idempotency-Key``."""
    if not any(message.role == "assistant" for message in messages[:-1]):
        return None
    conversation = [session_id, user_id, [m.model_dump(mode="json") for m in messages]]
    encoded = json.dumps(conversation, sort_keys=True, ensure_ascii=False).encode()
    return "conv-" + hashlib.sha256(encoded).hexdigest()[:40]


async def usage_of(traces: TraceStore, reply: AgentReply) -> dict[str, int]:
    """OpenAI's ``usage`` of the turn's run (every model call of the turn)."""
    run = await traces.aget_run(reply.run_id)
    prompt = run.prompt_tokens if run is not None else 0
    completion = run.completion_tokens if run is not None else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    completion_id: str,
    body: ChatCompletionRequest,
    reply: AgentReply,
    reason: FinishReason,
    usage: dict[str, int],
    created: int,
) -> dict[str, Any]:
    """A chat completion: one choice, the reply's text."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.text},
                "finish_reason": reason,
            }
        ],
        "usage": usage,
        "keel": reply.model_dump(mode="json"),
    }


@dataclass
class ChunkWriter:
    """The server-sent events of one streamed completion."""

    completion_id: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(
        self,
        delta: dict[str, Any],
        finish: FinishReason | None = None,
        **more: Any,
    ) -> bytes:
        """One ``chat.completion.chunk`` with one choice."""
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return self._event({"choices": [choice], **more})

    def usage(self, usage: dict[str, int]) -> bytes:
        """The last chunk with ``stream_options.include_usage``: no choice, the usage."""
        return self._event({"choices": [], "usage": usage})

    @staticmethod
    def error(status: int, kind: str, message: str) -> bytes:
        """An error after the first byte, as the ``openai`` SDK reads it (it raises
        ``APIError``): a ``data:`` event holding OpenAI's error object."""
        payload = {"error": openai_error(status, kind, message)}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def _event(self, fields: dict[str, Any]) -> bytes:
        payload = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            **fields,
        }
        if self.include_usage:
            payload.setdefault("usage", None)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
