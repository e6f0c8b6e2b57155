"""The service's errors: one body per API. keel's routes answer ``{"error": {"type": ...,
"message": ...}}`` for every error, an unknown route or a wrong method included; the OpenAI
routes (``/v1/chat/completions``, ``/v1/models``) answer OpenAI's ``{"error": {"message": ...,
"type": ..., "param": ..., "code": ...}}``, which the ``openai`` SDK reads. Also the map from
keel's exceptions to HTTP statuses."""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from keel.errors import (
    AccessDeniedError,
    ApprovalSettledError,
    BackendUnavailableError,
    ConflictError,
    KeelError,
    SessionBusyError,
    StoreError,
    UsageError,
)
from keel.service._logging import log_store_failure

__all__ = [
    "STORE_UNAVAILABLE",
    "HTTPError",
    "RateLimited",
    "describe",
    "draining_response",
    "error_response",
    "error_status",
    "install_error_handlers",
    "is_openai_path",
    "openai_error",
    "retry_after",
]

_OPENAI_ROUTES = ("/v1/chat/completions", "/v1/models")
_UNPARSED = "There was an error parsing the body"


class HTTPError(Exception):
    """An error a route answers with, as keel's error body."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        """The request parameter at fault (OpenAI's error body names it)."""
        self.extra = extra
        """More top-level fields of the body (a failed turn's reply, under ``keel``)."""


class RateLimited(HTTPError):
    """429 with ``Retry-After``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(
            429, "RateLimited", f"too many requests for this key; retry in {retry_after_s:g} s"
        )
        self.retry_after_s = retry_after_s


STORE_UNAVAILABLE = "a store did not answer; try again later"
"""The message of every 503 a store's failure causes."""


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI routes, which answer OpenAI's error body."""
    return path in _OPENAI_ROUTES or path.startswith("/v1/models/")


def openai_error(status: int, kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for one of keel's errors: ``type`` as OpenAI names the class of
    error, ``code`` keel's kind in OpenAI's snake case (``invalid_api_key``, ``model_failed``)."""
    if status == 429:
        kind_of_error = "requests"
    elif status >= 500:
        kind_of_error = "server_error"
    else:
        kind_of_error = "invalid_request_error"
    code = _OPENAI_CODES.get(kind) or re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
    return {"message": message, "type": kind_of_error, "param": param, "code": code}


_OPENAI_CODES = {"Unauthorized": "invalid_api_key", "RateLimited": "rate_limit_exceeded"}


def error_response(
    status: int,
    kind: str,
    message: str,
    *,
    path: str | None = None,
    param: str | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """The error body of the API ``path`` belongs to: keel's, or OpenAI's on the OpenAI
    routes (the status is keel's either way: 422 for a body that does not validate)."""
    if path is not None and is_openai_path(path):
        body: dict[str, Any] = {"error": openai_error(status, kind, message, param)}
    else:
        body = {"error": {"type": kind, "message": message}}
    return JSONResponse({**body, **(extra or {})}, status_code=status)


def draining_response(path: str | None = None) -> JSONResponse:
    """503 while the server shuts down."""
    response = error_response(
        503, "Draining", "this server is shutting down; send it elsewhere", path=path
    )
    response.headers["Retry-After"] = "1"
    return response


def retry_after(exc: KeelError) -> str:
    """The ``Retry-After`` (whole seconds, at least 1) of a 503 a store's failure causes: a
    store known to be down is tried again about that often."""
    seconds = getattr(exc, "retry_after_s", 1.0)
    return str(max(1, round(seconds)))


def error_status(exc: KeelError) -> int:
    """The HTTP status of one of keel's exceptions."""
    if isinstance(exc, AccessDeniedError):
        return 404  # another user's session: as if it did not exist
    if isinstance(exc, SessionBusyError | ConflictError | ApprovalSettledError):
        return 409
    if isinstance(exc, UsageError):
        return 422
    if isinstance(exc, BackendUnavailableError | StoreError):
        return 503
    return 500


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPError)
    response = error_response(
        exc.status,
        exc.kind,
        exc.message,
        path=request.url.path,
        param=exc.param,
        extra=exc.extra,
    )
    if isinstance(exc, RateLimited):
        response.headers["Retry-After"] = str(int(exc.retry_after_s))
    return response


async def _on_invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        f"{'.'.join(str(p) for p in problem.get('loc', ()))}: {problem.get('msg', '')}"
        for problem in exc.errors()
    ]
    path = request.url.path
    if any(problem.get("type") == "json_invalid" for problem in exc.errors()):
        return error_response(400, "MalformedJSON", "; ".join(problems), path=path)
    fields = [problem.get("loc", ()) for problem in exc.errors()]
    # OpenAI's body names the parameter: the first field at fault, without "body".
    param = ".".join(str(p) for p in fields[0] if p != "body") if fields else None
    return error_response(422, "ValidationError", "; ".join(problems), path=path, param=param)


def describe(exc: KeelError) -> tuple[int, str, str]:
    """One of keel's exceptions as a client is told it: status, kind, message (whether it
    arrives as a response or as an event of a stream already started)."""
    status = error_status(exc)
    if status == 404:
        return status, "NotFound", "not found"
    if status == 503:
        # A store's error names its database, host or driver: none of the client's business.
        return status, type(exc).__name__, STORE_UNAVAILABLE
    return status, type(exc).__name__, str(exc)


async def _on_keel_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KeelError)
    if error_status(exc) == 503:
        route = getattr(request.scope.get("route"), "path", "unmatched")
        log_store_failure(request.method, route, exc)
        response = error_response(*describe(exc), path=request.url.path)
        response.headers["Retry-After"] = retry_after(exc)
        return response
    return error_response(*describe(exc), path=request.url.path)


async def _on_starlette_error(request: Request, exc: Exception) -> JSONResponse:
    """What the framework itself answers (no such route, a wrong method, a body it could not
    parse), in the API's own error body instead of FastAPI's ``{"detail": ...}``."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 404:
        kind, message = "NotFound", f"no route {request.url.path!r}"
    elif status == 405:
        # Starlette names the header "Allow"; HTTP header names are case-insensitive.
        allowed = next(
            (value for name, value in (exc.headers or {}).items() if name.lower() == "allow"), ""
        )
        kind, message = "MethodNotAllowed", f"{request.method} is not allowed here ({allowed})"
    elif status == 400 and exc.detail == _UNPARSED:
        # FastAPI's answer when json.loads raises something other than a syntax error:
        # bytes that are not UTF-8, or nesting deeper than the parser's recursion.
        kind = "MalformedJSON"
        message = "the body is not JSON keel can read (invalid UTF-8, or nested too deeply)"
    else:
        phrases = {known.value: known.phrase for known in HTTPStatus}
        kind = re.sub(r"[^A-Za-z]", "", phrases.get(status, "Error").title())
        message = str(exc.detail)
    response = error_response(status, kind, message, path=request.url.path)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the error body of the API its route belongs to."""
    app.add_exception_handler(HTTPError, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(KeelError, _on_keel_error)
    app.add_exception_handler(HTTPException, _on_starlette_error)
