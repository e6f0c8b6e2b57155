"""The agent as an HTTP service: FastAPI routes over one agent per tenant, on shared stores.

Every route but ``/health`` and ``/ready`` needs ``Authorization: Bearer <key>``; the key names
the tenant, the request body never does. Everything a route reads or writes is scoped to that
tenant (sessions through the agent's tenant-scoped keys, runs by their tenant), and what
belongs to another tenant is answered 404, exactly as what does not exist.

Errors have one body, ``{"error": {"type": ..., "message": ...}}``: 400 malformed JSON, 401 no
or a bad key, 404 unknown (or another tenant's), 409 a session another turn holds, 413 a body
over the limit, 422 a body that does not validate, 503 a store that is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as ASGIScope

from keel.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    ConflictError,
    KeelError,
    SessionBusyError,
    StateError,
    StoreError,
    UsageError,
)
from keel.runtime import AgentReply, TextDelta, TurnFinished
from keel.service._drain import Drain
from keel.service._keys import CachedKeys
from keel.service._limits import RateLimiter
from keel.tracing import RunQuery, RunStatus

if TYPE_CHECKING:
    from keel.memory import Memory
    from keel.runtime import Agent
    from keel.service._keys import APIKeys
    from keel.tools import ToolJournal
    from keel.tracing import TraceStore

__all__ = ["ChatCompletionRequest", "TurnRequest", "create_app"]


class TurnRequest(BaseModel):
    """One user message for a session."""

    model_config = ConfigDict(extra="forbid")

    message: str = Field(min_length=1, max_length=100_000, description="What the user wrote.")
    user: str = Field(min_length=1, max_length=256, description="The user the session belongs to.")


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: dict[str, str]


class _HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class RevertRequest(BaseModel):
    """Which version to go back to, on which version the caller read."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="The version whose state becomes the newest.")
    expected_version: int = Field(ge=1, description="The session's version the caller read.")


class Resolution(BaseModel):
    """What an operator found an in-doubt call did."""

    model_config = ConfigDict(extra="forbid")

    ok: bool = Field(description="Whether the call took effect.")
    content: str = Field(min_length=1, max_length=10_000, description="What to tell the model.")


class MemoryAddition(BaseModel):
    """A note to remember for one user."""

    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1, max_length=20_000)
    kind: Literal["episodic", "semantic", "procedural"] = "semantic"


class ChatMessage(BaseModel):
    """One message of an OpenAI chat completion request (only what keel reads is checked)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request; keel uses the newest user message."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None

    def newest_user_text(self) -> str:
        for message in reversed(self.messages):
            if message.role != "user":
                continue
            content = message.content
            if isinstance(content, list):
                content = "".join(
                    str(part.get("text", "")) for part in content if part.get("type") == "text"
                )
            if content:
                return content
        raise _HTTPError(422, "ValidationError", "messages hold no user message with text")


def _journal_of(agent: Agent) -> ToolJournal:
    if agent.journal is None:
        raise _HTTPError(404, "NotFound", "this service keeps no durable tool journal")
    return agent.journal


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _turn_id(idempotency_key: str | None) -> str | None:
    """The agent's turn id for a request's ``Idempotency-Key`` (bounded, plain characters)."""
    if idempotency_key is None:
        return None
    return "idem-" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:40]


class _RateLimited(_HTTPError):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(
            429, "RateLimited", f"too many requests for this key; retry in {retry_after_s:g} s"
        )
        self.retry_after_s = retry_after_s


def _error_status(exc: KeelError) -> int:
    if isinstance(exc, AccessDeniedError):
        return 404  # another user's session: as if it did not exist
    if isinstance(exc, SessionBusyError | ConflictError):
        return 409
    if isinstance(exc, UsageError):
        return 422
    if isinstance(exc, BackendUnavailableError | StoreError):
        return 503
    return 500


def create_app(
    agent_for: Callable[[str], Agent],
    keys: APIKeys,
    traces: TraceStore,
    *,
    max_body_bytes: int = 1_000_000,
    key_cache_s: float = 30.0,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    metrics_token: str | None = None,
    tenants: Callable[[], Iterable[str]] | None = None,
    rate_limiter: RateLimiter | None = None,
    drain: Drain | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
    ui: bool = True,
) -> FastAPI:
    """The service's FastAPI app.

    Args:
        agent_for: the agent of a tenant (made once per tenant, on shared stores).
        keys: the API keys.
        traces: the trace store the agents write to (``/v1/runs``).
        max_body_bytes: larger request bodies get 413 before they are read whole.
        key_cache_s: how long a verified key is trusted without a look-up (a revoked key
            stops working within this time).
        on_shutdown: awaited when the server stops (close the agents' stores there).
        metrics_token: the operator's token for ``/metrics`` (Prometheus text format); the
            metrics name tenants, so without a token the route does not exist.
        tenants: the tenants whose agents exist (their death-spiral indicators are exported).
        rate_limiter: requests per key and minute; over it, 429 with ``Retry-After``.
        drain: shared with a :class:`DrainingServer`: while it drains, new turns get 503 and
            the turns in flight are counted until they end.
        ready: awaited by ``/ready`` (and once at start-up, to warm what it opens); it raises
            :class:`~keel.errors.BackendUnavailableError` while a store does not answer.
        ui: serve the web trace viewer at ``/ui`` (it signs in with the same API keys).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ready is not None:
            # Open the stores' connections before traffic comes; a store that is down now
            # is reported by /ready rather than stopping the server.
            with contextlib.suppress(BackendUnavailableError, StoreError):
                await ready()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(
        lifespan=lifespan,
        title="keel",
        description="An agent runtime: sessions, turns (JSON or server-sent events), runs.",
        version="1",
    )
    tenant_of_key = CachedKeys(keys.tenant_of, key_cache_s, keys.atenant_of)

    def error(status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)

    def draining() -> JSONResponse:
        return error(503, "Draining", "this server is shutting down; send it elsewhere")

    @app.exception_handler(_HTTPError)
    async def on_http_error(request: Request, exc: _HTTPError) -> JSONResponse:
        response = error(exc.status, exc.kind, exc.message)
        if isinstance(exc, _RateLimited):
            response.headers["Retry-After"] = str(int(exc.retry_after_s))
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in problem.get('loc', ()))}: {problem.get('msg', '')}"
            for problem in exc.errors()
        ]
        malformed = any(problem.get("type") == "json_invalid" for problem in exc.errors())
        if malformed:
            return error(400, "MalformedJSON", "; ".join(problems))
        return error(422, "ValidationError", "; ".join(problems))

    @app.exception_handler(KeelError)
    async def on_keel_error(request: Request, exc: KeelError) -> JSONResponse:
        status = _error_status(exc)
        message = "not found" if status == 404 else str(exc)
        return error(status, "NotFound" if status == 404 else type(exc).__name__, message)

    requests: Counter[tuple[str, str, int]] = Counter()
    turns: Counter[tuple[str, str]] = Counter()

    turn_paths = ("/turns", "/chat/completions")

    def gate(app: ASGIApp) -> ASGIApp:
        """Body limit, drain gate and request counts: plain ASGI, not ``BaseHTTPMiddleware``,
        which runs every request in its own task group and pipes the response through a
        memory stream (a cost on each turn, on the event loop the turns share)."""

        async def gated(scope: ASGIScope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            status = 500

            async def counted_send(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            method = scope["method"]
            is_turn = method == "POST" and scope["path"].endswith(turn_paths)
            length = Headers(scope=scope).get("content-length")
            if length is not None and length.isdigit() and int(length) > max_body_bytes:
                response = error(413, "BodyTooLarge", f"the body is over {max_body_bytes} bytes")
                await response(scope, receive, counted_send)
            elif is_turn and drain is not None and drain.draining:
                response = draining()
                response.headers["Retry-After"] = "1"
                await response(scope, receive, counted_send)
            elif is_turn and drain is not None:
                drain.enter()
                try:
                    # A turn's response, streamed or not, is sent whole before the app
                    # returns: the turn leaves the count once its last event is out.
                    await app(scope, receive, counted_send)
                finally:
                    drain.leave()
            else:
                await app(scope, receive, counted_send)
            route = scope.get("route")
            requests[(method, getattr(route, "path", "unmatched"), status)] += 1

        return gated

    app.add_middleware(gate)

    def counted(tenant_id: str, reply: AgentReply) -> AgentReply:
        turns[(tenant_id, reply.status)] += 1
        return reply

    async def tenant(authorization: str | None = Header(default=None)) -> str:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise _HTTPError(401, "Unauthorized", "send Authorization: Bearer <API key>")
        found = await tenant_of_key.acheck(key)
        if found is None:
            raise _HTTPError(401, "Unauthorized", "unknown or revoked API key")
        return found

    async def limited_tenant(
        tenant_id: str = Depends(tenant), authorization: str | None = Header(default=None)
    ) -> str:
        if rate_limiter is not None:
            fingerprint = hashlib.sha256((authorization or "").encode()).hexdigest()[:32]
            wait = await rate_limiter.check(fingerprint)
            if wait is not None:
                raise _RateLimited(wait)
        return tenant_id

    @app.get("/metrics", include_in_schema=False)
    async def metrics(authorization: str | None = Header(default=None)) -> Any:
        """Prometheus metrics: requests, turns by status, and each tenant agent's death-spiral
        indicators (retry rate, tokens per call, state resets, time to first token)."""
        scheme, _, token = (authorization or "").partition(" ")
        if metrics_token is None:
            raise _HTTPError(404, "NotFound", "not found")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token, metrics_token):
            raise _HTTPError(401, "Unauthorized", "send Authorization: Bearer <metrics token>")
        lines = [
            "# HELP keel_http_requests_total HTTP requests by method, route and status.",
            "# TYPE keel_http_requests_total counter",
        ]
        for (method, path, status), count in sorted(requests.items()):
            lines.append(
                f'keel_http_requests_total{{method="{method}",route="{_label(path)}",'
                f'status="{status}"}} {count}'
            )
        lines += [
            "# HELP keel_turns_total Turns by tenant and how they ended.",
            "# TYPE keel_turns_total counter",
        ]
        for (tenant_id, ended), count in sorted(turns.items()):
            lines.append(
                f'keel_turns_total{{tenant="{_label(tenant_id)}",status="{ended}"}} {count}'
            )
        gauges: dict[str, tuple[str, str]] = {
            "keel_model_calls_window": ("Model calls in the indicators' window.", "calls"),
            "keel_retry_rate": ("Share of model calls that were retries.", "retry_rate"),
            "keel_prompt_tokens_per_call": ("Average prompt tokens per call.", "avg_prompt_tokens"),
            "keel_state_resets": ("Workflow state resets in the window.", "state_resets"),
            "keel_ttft_ms": ("Average time to first token.", "avg_ttft_ms"),
        }
        snapshots = []
        for tenant_id in sorted(tenants() if tenants is not None else ()):
            agent = agent_for(tenant_id)
            snapshots.append((tenant_id, agent.monitor.snapshot(agent=agent.name)))
        for name, (help_text, field) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for tenant_id, snapshot in snapshots:
                measured = getattr(snapshot, field)
                if measured is not None:
                    lines.append(f'{name}{{tenant="{_label(tenant_id)}"}} {float(measured):g}')
        lines += [
            "# HELP keel_spiral_warnings Death-spiral indicators past their thresholds.",
            "# TYPE keel_spiral_warnings gauge",
        ]
        for tenant_id, snapshot in snapshots:
            lines.append(
                f'keel_spiral_warnings{{tenant="{_label(tenant_id)}"}} {len(snapshot.warnings)}'
            )
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the process serves."""
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "Draining, or a store does not answer"}})
    async def readiness() -> Any:
        """Readiness: the stores answer and the server is not draining (a load balancer sends
        turns only to a ready worker)."""
        if drain is not None and drain.draining:
            return draining()
        if ready is not None:
            await ready()
        return {"status": "ready"}

    @app.post("/v1/sessions/{session_id}/turns", response_model=None)
    async def post_turn(
        session_id: str,
        turn: TurnRequest,
        request: Request,
        tenant_id: str = Depends(limited_tenant),
        idempotency_key: str | None = Header(default=None, max_length=255),
    ) -> Any:
        """Send one user message. ``Accept: text/event-stream`` streams the turn's events
        (server-sent events, one JSON event each, the reply last); otherwise the reply.

        With an ``Idempotency-Key``, sending the same request again (after a timeout, a dead
        worker) runs the turn once: a committed turn's reply comes back (``replayed``), a turn
        left open is finished. The same key with another message is 422."""
        agent = agent_for(tenant_id)
        turn_id = _turn_id(idempotency_key)
        if "text/event-stream" not in request.headers.get("accept", ""):
            reply = await agent.run(
                turn.message, session=session_id, user=turn.user, turn_id=turn_id
            )
            return counted(tenant_id, reply).model_dump(mode="json")

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in agent.stream(
                    turn.message, session=session_id, user=turn.user, turn_id=turn_id
                ):
                    if isinstance(event, TurnFinished):
                        counted(tenant_id, event.reply)
                    payload = event.model_dump_json()
                    yield f"event: {event.type}\ndata: {payload}\n\n".encode()
            except KeelError as exc:
                status = _error_status(exc)
                body = json.dumps(
                    {"type": type(exc).__name__, "message": str(exc), "status": status}
                )
                yield f"event: error\ndata: {body}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        tenant_id: str = Depends(limited_tenant),
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
            raise _HTTPError(
                422,
                "ValidationError",
                "name the session and the user: X-Keel-Session and X-Keel-User headers, or "
                "metadata.session_id and metadata.user_id",
            )
        text = body.newest_user_text()
        agent = agent_for(tenant_id)
        turn_id = _turn_id(idempotency_key)
        created = int(time.time())
        if not body.stream:
            reply = counted(
                tenant_id,
                await agent.run(text, session=session_id, user=user_id, turn_id=turn_id),
            )
            run = traces.get_run(reply.run_id)
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
                        counted(tenant_id, event.reply)
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
                body_ = {"error": {"type": type(exc).__name__, "message": str(exc)}}
                yield f"data: {json.dumps(body_)}\n\n".encode()
                return
            yield chunk({}, "stop", completion_id)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/v1/sessions/{session_id}")
    async def get_session(
        session_id: str, tenant_id: str = Depends(limited_tenant)
    ) -> dict[str, Any]:
        """The session's committed state and version."""
        agent = agent_for(tenant_id)
        checkpoint = await agent.state.aget(agent.session_key(session_id))
        if checkpoint is None:
            raise _HTTPError(404, "NotFound", "not found")
        return {
            "session_id": session_id,
            "version": checkpoint.version,
            "state": checkpoint.state.model_dump(mode="json"),
        }

    @app.get("/v1/sessions/{session_id}/checkpoints")
    async def get_checkpoints(
        session_id: str,
        tenant_id: str = Depends(limited_tenant),
        limit: int = Query(default=50, ge=1, le=1000),
    ) -> list[dict[str, Any]]:
        """The session's checkpoint history, newest first."""
        agent = agent_for(tenant_id)
        history = await agent.state.ahistory(agent.session_key(session_id), limit=limit)
        if not history:
            raise _HTTPError(404, "NotFound", "not found")
        return [info.model_dump(mode="json", exclude={"session_id"}) for info in history]

    @app.post("/v1/sessions/{session_id}/revert")
    async def revert_session(
        session_id: str, revert: RevertRequest, tenant_id: str = Depends(limited_tenant)
    ) -> dict[str, Any]:
        """Put the session back to an earlier version, as a new version: compare-and-set on
        ``expected_version`` (409 when another writer moved the session since)."""
        agent = agent_for(tenant_id)
        key = agent.session_key(session_id)
        if await agent.state.aget(key) is None:
            raise _HTTPError(404, "NotFound", "not found")
        try:
            checkpoint = await agent.state.arevert(
                key, expected_version=revert.expected_version, to_version=revert.version
            )
        except StateError as exc:
            raise _HTTPError(404, "NotFound", str(exc)) from None
        return {"session_id": session_id, "version": checkpoint.version}

    @app.get("/v1/sessions/{session_id}/in-doubt")
    async def session_in_doubt(
        session_id: str, tenant_id: str = Depends(limited_tenant)
    ) -> list[dict[str, Any]]:
        """Side-effecting calls of the session that started and recorded no result."""
        agent = agent_for(tenant_id)
        journal = _journal_of(agent)
        entries = await asyncio.to_thread(journal.in_doubt, agent.session_key(session_id))
        return [entry.model_dump(mode="json", exclude={"session_id"}) for entry in entries]

    @app.post("/v1/tools/in-doubt/{key}/resolve")
    async def resolve_in_doubt(
        key: str, resolution: Resolution, tenant_id: str = Depends(limited_tenant)
    ) -> dict[str, Any]:
        """An operator's verdict on an in-doubt call: what really happened. A resumed turn then
        tells the model that, instead of running the tool again."""
        agent = agent_for(tenant_id)
        journal = _journal_of(agent)
        entry = await journal.aget(key)
        # A journal entry's session is a tenant-scoped session key ("tenant/session").
        scope = agent.session_key("x")[: -len("x")]
        if entry is None or not entry.session_id.startswith(scope) or not entry.in_doubt:
            raise _HTTPError(404, "NotFound", "not found")
        resolved = await asyncio.to_thread(
            journal.resolve, key, ok=resolution.ok, content=resolution.content
        )
        return resolved.model_dump(mode="json", exclude={"session_id"})

    def memory_of(agent: Agent) -> Memory:
        if agent.memory is None:
            raise _HTTPError(404, "NotFound", "this service runs without long-term memory")
        return agent.memory

    @app.get("/v1/memory/search")
    async def search_memory(
        user: str = Query(min_length=1, max_length=256),
        q: str = Query(min_length=1, max_length=2_000),
        k: int = Query(default=10, ge=1, le=100),
        tenant_id: str = Depends(limited_tenant),
    ) -> list[dict[str, Any]]:
        """The user's most relevant memories for ``q``, with why each ranked."""
        from keel.memory import Scope

        memory = memory_of(agent_for(tenant_id))
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

    @app.post("/v1/memory", status_code=201)
    async def add_memory(
        record: MemoryAddition, tenant_id: str = Depends(limited_tenant)
    ) -> dict[str, Any]:
        """Remember a note for the user (masked before it is stored; a user claim)."""
        from keel.memory import Scope

        memory = memory_of(agent_for(tenant_id))
        added = await memory.aadd(
            record.text, scope=Scope(tenant_id=tenant_id, user_id=record.user), kind=record.kind
        )
        return added.model_dump(mode="json", exclude={"embedding"})

    @app.delete("/v1/memory/{record_id}")
    async def forget_memory(
        record_id: str,
        user: str = Query(min_length=1, max_length=256),
        tenant_id: str = Depends(limited_tenant),
    ) -> dict[str, Any]:
        """Forget one of the user's memories (404 when the user has no such record)."""
        from keel.memory import Scope

        memory = memory_of(agent_for(tenant_id))
        scope = Scope(tenant_id=tenant_id, user_id=user)
        if not await asyncio.to_thread(memory.forget, scope, record_id):
            raise _HTTPError(404, "NotFound", "not found")
        return {"forgotten": record_id}

    @app.get("/v1/runs")
    async def list_runs(
        tenant_id: str = Depends(limited_tenant),
        session: str | None = None,
        status: RunStatus | None = None,
        limit: int = Query(default=50, ge=1, le=1000),
    ) -> list[dict[str, Any]]:
        """The tenant's runs, newest first (``session``, ``status`` filters)."""
        query = RunQuery(tenant_id=tenant_id, session_id=session, status=status, limit=limit)
        return [run.model_dump(mode="json") for run in traces.list_runs(query)]

    @app.get("/v1/runs/{run_id}")
    async def get_run(run_id: str, tenant_id: str = Depends(limited_tenant)) -> dict[str, Any]:
        """One run with its steps."""
        detail = traces.get_run_detail(run_id)
        if detail is None or detail.run.tenant_id != tenant_id:
            raise _HTTPError(404, "NotFound", "not found")
        return detail.model_dump(mode="json")

    if ui:
        from keel.ui import mount_ui

        mount_ui(app, agent_for, tenant_of_key, traces)
    return app
