"""The service's errors: one body, ``{"error": {"type": ..., "message": ...}}``, for every
error keel's routes answer, and the map from keel's exceptions to HTTP statuses."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from keel.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    ConflictError,
    KeelError,
    SessionBusyError,
    StoreError,
    UsageError,
)
from keel.service._logging import log_store_failure

__all__ = [
    "HTTPError",
    "RateLimited",
    "draining_response",
    "error_response",
    "error_status",
    "install_error_handlers",
]


class HTTPError(Exception):
    """An error a route answers with, as keel's error body."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class RateLimited(HTTPError):
    """429 with ``Retry-After``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(
            429, "RateLimited", f"too many requests for this key; retry in {retry_after_s:g} s"
        )
        self.retry_after_s = retry_after_s


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    """keel's error body."""
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


def draining_response() -> JSONResponse:
    """503 while the server shuts down."""
    response = error_response(503, "Draining", "this server is shutting down; send it elsewhere")
    response.headers["Retry-After"] = "1"
    return response


def error_status(exc: KeelError) -> int:
    """The HTTP status of one of keel's exceptions."""
    if isinstance(exc, AccessDeniedError):
        return 404  # another user's session: as if it did not exist
    if isinstance(exc, SessionBusyError | ConflictError):
        return 409
    if isinstance(exc, UsageError):
        return 422
    if isinstance(exc, BackendUnavailableError | StoreError):
        return 503
    return 500


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPError)
    response = error_response(exc.status, exc.kind, exc.message)
    if isinstance(exc, RateLimited):
        response.headers["Retry-After"] = str(int(exc.retry_after_s))
    return response


async def _on_invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        f"{'.'.join(str(p) for p in problem.get('loc', ()))}: {problem.get('msg', '')}"
        for problem in exc.errors()
    ]
    if any(problem.get("type") == "json_invalid" for problem in exc.errors()):
        return error_response(400, "MalformedJSON", "; ".join(problems))
    return error_response(422, "ValidationError", "; ".join(problems))


async def _on_keel_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KeelError)
    status = error_status(exc)
    if status == 503:
        route = getattr(request.scope.get("route"), "path", "unmatched")
        log_store_failure(request.method, route, exc)
    message = "not found" if status == 404 else str(exc)
    return error_response(status, "NotFound" if status == 404 else type(exc).__name__, message)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of keel's routes with keel's error body."""
    app.add_exception_handler(HTTPError, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(KeelError, _on_keel_error)
