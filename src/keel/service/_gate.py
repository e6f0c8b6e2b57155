"""The gate every HTTP request passes: the body limit, the drain gate for turns, and the
request counts ``/metrics`` exports."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as ASGIScope

from keel.service._context import ServiceContext
from keel.service._errors import draining_response, error_response

__all__ = ["Gate"]

_TURN_PATHS = ("/turns", "/chat/completions")


class Gate:
    """Plain ASGI middleware, not ``BaseHTTPMiddleware``, which runs every request in its own
    task group and pipes the response through a memory stream (a cost on each turn, on the
    event loop the turns share)."""

    def __init__(self, app: ASGIApp, context: ServiceContext, max_body_bytes: int) -> None:
        self.app = app
        self.context = context
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        method = scope["method"]
        drain = self.context.drain
        is_turn = method == "POST" and scope["path"].endswith(_TURN_PATHS)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            response = error_response(
                413, "BodyTooLarge", f"the body is over {self.max_body_bytes} bytes"
            )
            await response(scope, receive, counted_send)
        elif is_turn and drain is not None and drain.draining:
            await draining_response()(scope, receive, counted_send)
        elif is_turn and drain is not None:
            drain.enter()
            try:
                # A turn's response, streamed or not, is sent whole before the app
                # returns: the turn leaves the count once its last event is out.
                await self.app(scope, receive, counted_send)
            finally:
                drain.leave()
        else:
            await self.app(scope, receive, counted_send)
        route = scope.get("route")
        self.context.requests[(method, getattr(route, "path", "unmatched"), status)] += 1
