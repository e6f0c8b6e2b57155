"""What the service logs: one access line per request (``keel.access``, INFO) and each store
failure it answered 503 for (``keel.service``, WARNING, with the failure's cause).

An access line holds the method, the route's template (``/v1/sessions/{session_id}/turns``,
never the path a client sent), the status, the duration, the tenant and the run id: never a
key, a header or a body. The routes add the tenant and the run id to the request's
`RequestFacts` as they learn them; the gate logs the line once the response is out.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ACCESS_LOGGER",
    "SERVICE_LOGGER",
    "JSONFormatter",
    "LogFormat",
    "RequestFacts",
    "log_access",
    "log_store_failure",
    "logging_config",
    "note_run",
    "note_tenant",
    "request_facts",
]

ACCESS_LOGGER = logging.getLogger("keel.access")
SERVICE_LOGGER = logging.getLogger("keel.service")

LogFormat = Literal["text", "json"]


@dataclass
class RequestFacts:
    """What the access line of one request says beyond its method, route and status."""

    tenant: str | None = None
    run_id: str | None = None


request_facts: ContextVar[RequestFacts | None] = ContextVar("keel_request_facts", default=None)
"""The facts of the request being served (the gate sets them; a streamed body's task sees the
same object, so what it notes reaches the line)."""


def note_tenant(tenant_id: str) -> None:
    """The request acts for ``tenant_id`` (its key named it)."""
    facts = request_facts.get()
    if facts is not None:
        facts.tenant = tenant_id


def note_run(run_id: str) -> None:
    """The request ran (or replayed) the turn traced as ``run_id``."""
    facts = request_facts.get()
    if facts is not None:
        facts.run_id = run_id


def log_access(method: str, route: str, status: int, started: float, facts: RequestFacts) -> None:
    """One request's access line (``started``: its ``time.perf_counter()``)."""
    if not ACCESS_LOGGER.isEnabledFor(logging.INFO):
        return
    duration_ms = round((time.perf_counter() - started) * 1000, 1)
    fields = {
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": duration_ms,
        "tenant": facts.tenant,
        "run_id": facts.run_id,
    }
    ACCESS_LOGGER.info(
        "%s %s %s %.1f ms tenant=%s run=%s",
        method,
        route,
        status,
        duration_ms,
        facts.tenant or "-",
        facts.run_id or "-",
        extra={"keel": fields},
    )


def log_store_failure(method: str, route: str, exc: BaseException) -> None:
    """A store failure a request was answered 503 for, with what caused it (the client's
    message names no database; the operator's log does)."""
    cause = exc.__cause__ or exc.__context__
    because = f"; cause: {type(cause).__name__}: {cause}" if cause is not None else ""
    SERVICE_LOGGER.warning(
        "store failure on %s %s: %s: %s%s",
        method,
        route,
        type(exc).__name__,
        exc,
        because,
        extra={"keel": {"method": method, "route": route, "error": type(exc).__name__}},
    )


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "keel", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def logging_config(log_format: LogFormat = "text") -> dict[str, Any]:
    """uvicorn's ``log_config`` for the service (each worker process applies it): keel's
    access lines and store failures at INFO, uvicorn's own messages at WARNING, its access
    log off (keel's line replaces it), all on stderr, as text or JSON lines."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format {log_format!r}: text or json")
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JSONFormatter"}
        if log_format == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"keel": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "keel",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "keel": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
            "keel.access": {"level": "INFO"},
            "keel.service": {"level": "INFO"},
            "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
