"""Operations: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import PlainTextResponse

from keel.errors import StoreError
from keel.service._context import ServiceContext, context_of
from keel.service._errors import HTTPError, draining_response, error_response, retry_after
from keel.service._logging import log_store_failure

__all__ = ["router"]

router = APIRouter()

_GAUGES: dict[str, tuple[str, str]] = {
    "keel_model_calls_window": ("Model calls in the indicators' window.", "calls"),
    "keel_retry_rate": ("Share of model calls that were retries.", "retry_rate"),
    "keel_prompt_tokens_per_call": ("Average prompt tokens per call.", "avg_prompt_tokens"),
    "keel_state_resets": ("Workflow state resets in the window.", "state_resets"),
    "keel_ttft_ms": ("Average time to first token.", "avg_ttft_ms"),
}


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _counters(context: ServiceContext) -> list[str]:
    lines = [
        "# HELP keel_http_requests_total HTTP requests by method, route and status.",
        "# TYPE keel_http_requests_total counter",
    ]
    for (method, path, status), count in sorted(context.requests.items()):
        lines.append(
            f'keel_http_requests_total{{method="{method}",route="{_label(path)}",'
            f'status="{status}"}} {count}'
        )
    lines += [
        "# HELP keel_turns_total Turns by tenant and how they ended.",
        "# TYPE keel_turns_total counter",
    ]
    for (tenant_id, ended), count in sorted(context.turns.items()):
        lines.append(f'keel_turns_total{{tenant="{_label(tenant_id)}",status="{ended}"}} {count}')
    return lines


def _indicators(context: ServiceContext) -> list[str]:
    snapshots = []
    for tenant_id in sorted(context.tenants() if context.tenants is not None else ()):
        agent = context.agent_for(tenant_id)
        snapshots.append((tenant_id, agent.monitor.snapshot(agent=agent.name)))
    lines: list[str] = []
    for name, (help_text, field) in _GAUGES.items():
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
    return lines


@router.get("/metrics", include_in_schema=False)
async def metrics(
    context: ServiceContext = Depends(context_of),
    authorization: str | None = Header(default=None),
) -> Any:
    """Prometheus metrics: requests, turns by status, and each tenant agent's death-spiral
    indicators (retry rate, tokens per call, state resets, time to first token)."""
    scheme, _, token = (authorization or "").partition(" ")
    if context.metrics_token is None:
        raise HTTPError(404, "NotFound", "not found")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token, context.metrics_token):
        raise HTTPError(401, "Unauthorized", "send Authorization: Bearer <metrics token>")
    lines = _counters(context) + _indicators(context)
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "Draining, or a store does not answer"}})
async def readiness(context: ServiceContext = Depends(context_of)) -> Any:
    """Readiness: the stores answer and the server is not draining (a load balancer sends
    turns only to a ready worker). A store that does not answer: 503 with ``Retry-After``,
    ``{"status": "unavailable", "store": "postgresql"}`` (or ``"redis"``) and the error."""
    if context.drain is not None and context.drain.draining:
        return draining_response()
    if context.ready is not None:
        try:
            await context.ready()
        except StoreError as exc:
            # Which store, never its address or driver message: those are the operator's, in
            # the log line.
            log_store_failure("GET", "/ready", exc)
            store = exc.store or "a store"
            response = error_response(
                503,
                type(exc).__name__,
                f"not ready: {store} does not answer",
                extra={"status": "unavailable", "store": exc.store},
            )
            response.headers["Retry-After"] = retry_after(exc)
            return response
    return {"status": "ready"}
