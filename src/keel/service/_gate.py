"""The gate every HTTP request passes before a route sees it: the drain gate, the API key of a
turn, the body (counted as it arrives and read within a deadline), the request counts
``/metrics`` exports and the access log.

A turn counts as in flight (what a drain waits for) only once its key is checked and its body
is read whole: a client without a key, or one that sends half a body, holds nothing a shutdown
waits on. The body is read here, at most ``max_body_bytes`` of it whatever the client declared
(``Content-Length`` or chunked), then handed to the app: past the limit the request gets 413,
past the deadline 408, and the connection is closed, so the rest of an oversized body is
never read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as ASGIScope

from keel.errors import KeelError
from keel.service._context import ServiceContext, authenticated_caller
from keel.service._errors import (
    HTTPError,
    draining_response,
    error_response,
    error_status,
    retry_after,
)
from keel.service._logging import RequestFacts, log_access, log_store_failure, request_facts

__all__ = ["Gate"]

_TURN_PATHS = ("/turns", "/chat/completions")
_OPEN_WHILE_DRAINING = frozenset({"/health", "/ready", "/metrics"})
"""Answered while the server drains: liveness, readiness (which says it drains) and metrics."""
_CLIENT_GONE = 499
"""The status logged for a request whose client hung up before its body was in."""


class Gate:
    """Plain ASGI middleware, not ``BaseHTTPMiddleware``, which runs every request in its own
    task group and pipes the response through a memory stream (a cost on each turn, on the
    event loop the turns share).

    Args:
        app: the app behind the gate.
        context: the service's shared context (keys, drain, counters).
        max_body_bytes: the most body bytes read; past them, 413.
        body_timeout_s: the longest a whole body may take to arrive; past it, 408.
        routes: the app's routes, to name the route of a request the gate answers itself.
    """

    def __init__(
        self,
        app: ASGIApp,
        context: ServiceContext,
        max_body_bytes: int,
        body_timeout_s: float = 30.0,
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        self.app = app
        self.context = context
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.routes = tuple(routes)

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        facts = RequestFacts()
        token = request_facts.set(facts)
        status = 500

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            answered = await self._serve(scope, receive, counted_send)
            status = answered or status
        finally:
            request_facts.reset(token)
            method = scope["method"]
            route = self._template(scope)
            self.context.requests[(method, route, status)] += 1
            log_access(method, route, status, started, facts)

    async def _serve(self, scope: ASGIScope, receive: Receive, send: Send) -> int | None:
        """Serve one request; a status the gate logs itself (a client that left), or None."""
        drain = self.context.drain
        is_turn = scope["method"] == "POST" and scope["path"].endswith(_TURN_PATHS)
        if self._refused_while_draining(scope):
            await draining_response(scope["path"])(scope, receive, send)
            return None
        if is_turn:
            refusal = await self._key_refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return None
        length = Headers(scope=scope).get("content-length")
        declared_too_large = (
            length is not None and length.isdigit() and int(length) > self.max_body_bytes
        )
        body = 413 if declared_too_large else await self._body(receive)
        if body is None:
            return _CLIENT_GONE
        if isinstance(body, int):
            await self._refuse_body(body, scope, receive, send)
            return None
        if self._refused_while_draining(scope):  # the drain began while the body came in
            await draining_response(scope["path"])(scope, receive, send)
            return None
        replayed = _replaying(body, receive)
        if not (is_turn and drain is not None):
            await self.app(scope, replayed, send)
            return None
        drain.enter()
        try:
            # A turn's response, streamed or not, is sent whole before the app returns: the
            # turn leaves the count once its last event is out.
            await self.app(scope, replayed, send)
        finally:
            drain.leave()
        return None

    async def _key_refusal(self, scope: ASGIScope) -> JSONResponse | None:
        """Why a turn's key is refused (401, or 503 when the keys cannot be read), or None."""
        try:
            await authenticated_caller(self.context, Headers(scope=scope).get("authorization"))
        except HTTPError as exc:
            return error_response(exc.status, exc.kind, exc.message, path=scope["path"])
        except KeelError as exc:
            status = error_status(exc)
            if status == 503:
                log_store_failure(scope["method"], self._template(scope), exc)
            message = "the API keys cannot be read now"
            response = error_response(status, type(exc).__name__, message, path=scope["path"])
            if status == 503:
                response.headers["Retry-After"] = retry_after(exc)
            return response
        return None

    def _refused_while_draining(self, scope: ASGIScope) -> bool:
        drain = self.context.drain
        return drain is not None and drain.draining and scope["path"] not in _OPEN_WHILE_DRAINING

    async def _body(self, receive: Receive) -> bytes | int | None:
        """The whole body; or 413 at the limit, 408 at the deadline; None if the client left."""
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return 408
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return 413
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse_body(
        self, status: int, scope: ASGIScope, receive: Receive, send: Send
    ) -> None:
        if status == 413:
            response = error_response(
                413,
                "BodyTooLarge",
                f"the body is over {self.max_body_bytes} bytes",
                path=scope["path"],
            )
        else:
            response = error_response(
                408,
                "RequestTimeout",
                f"the body did not arrive within {self.body_timeout_s:g} s",
                path=scope["path"],
            )
        # The rest of the body is never read: the connection ends with this response.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    def _template(self, scope: ASGIScope) -> str:
        """The route's template (``/v1/runs/{run_id}``), also for a request the gate answered
        before routing; never the path the client sent."""
        route = scope.get("route")
        if route is None:
            for candidate in self.routes:
                match, _ = candidate.matches(scope)
                if match is not Match.NONE:
                    route = candidate
                    break
        return str(getattr(route, "path", "unmatched"))


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` whose first message is the body the gate read; later calls (a streamed
    response listening for the client to leave) go to the server."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
