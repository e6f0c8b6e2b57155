"""The agent as an HTTP service: FastAPI routers over one agent per tenant, on shared stores.

Every route but ``/health`` and ``/ready`` needs ``Authorization: Bearer <key>``; the key names
the tenant, the request body never does. Everything a route reads or writes is scoped to that
tenant (sessions through the agent's tenant-scoped keys, runs by their tenant), and what
belongs to another tenant is answered 404, exactly as what does not exist.

Errors have one body, ``{"error": {"type": ..., "message": ...}}``: 400 malformed JSON, 401 no
or a bad key, 404 unknown (or another tenant's), 408 a body too slow to arrive, 409 a session
another turn holds, 413 a body over the limit, 422 a body that does not validate, 503 a store
that is down or a server that drains. The OpenAI routes (``/v1/chat/completions``,
``/v1/models``) answer OpenAI's error body instead.

The routes live in `keel.service.routes`, one router per resource; what they share (the
agents, the keys, the limits, the counters) is a `ServiceContext` on ``app.state``,
reached through dependencies.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI

from keel.errors import BackendUnavailableError, StoreError
from keel.service import routes
from keel.service._carry_out import DEFAULT_EVERY_S, DecisionCarrier, carrying_out, service_carrier
from keel.service._context import ServiceContext
from keel.service._errors import install_error_handlers
from keel.service._gate import Gate
from keel.service._keys import CachedKeys
from keel.service._models import ChatCompletionRequest, TurnRequest
from keel.service._privacy import Disclosure
from keel.service._pruning import MemoryPruner, pruning
from keel.service._query import known_query

if TYPE_CHECKING:
    from keel.approvals import ApprovalStore
    from keel.privacy import Vault
    from keel.runtime import Agent
    from keel.service._drain import Drain
    from keel.service._keys import APIKeys
    from keel.service._limits import RateLimiter
    from keel.stores import ErasureReport
    from keel.tracing import TraceStore

__all__ = ["ChatCompletionRequest", "TurnRequest", "create_app"]

_ROUTERS = (
    routes.ops.router,
    routes.turns.router,
    routes.chat.router,
    routes.models.router,
    routes.sessions.router,
    routes.tools.router,
    routes.memory.router,
    routes.runs.router,
    routes.privacy.router,
    routes.approvals.router,
)


def _lifespan(
    ready: Callable[[], Awaitable[None]] | None,
    on_shutdown: Callable[[], Awaitable[None]] | None,
    carrier: DecisionCarrier | None = None,
    pruner: MemoryPruner | None = None,
    on_startup: Callable[[], Awaitable[None]] | None = None,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Whatever fails from here on (a server that cannot start, an embedder that cannot
        # load), what on_startup started and the stores are stopped before it is raised.
        try:
            if on_startup is not None:
                await on_startup()
            if ready is not None:
                # Open the stores' connections before traffic comes; a store that is down now
                # is reported by /ready rather than stopping the server.
                with contextlib.suppress(BackendUnavailableError, StoreError):
                    await ready()
            # Both stopped before the stores close.
            async with carrying_out(carrier), pruning(pruner):
                yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    return lifespan


def create_app(
    agent_for: Callable[[str], Agent],
    keys: APIKeys,
    traces: TraceStore,
    *,
    max_body_bytes: int = 1_000_000,
    body_timeout_s: float = 30.0,
    key_cache_s: float = 30.0,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    metrics_token: str | None = None,
    tenants: Callable[[], Iterable[str]] | None = None,
    rate_limiter: RateLimiter | None = None,
    drain: Drain | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
    ui: bool = True,
    vault: Vault | None = None,
    operators_see_values: bool = False,
    approvals: ApprovalStore | None = None,
    carry_out_every_s: float | None = DEFAULT_EVERY_S,
    erase_user: Callable[[str, str, str], Awaitable[ErasureReport]] | None = None,
    pruner: MemoryPruner | None = None,
) -> FastAPI:
    """The service's FastAPI app, assembled from its parts (the low-level door: to serve an
    agent in your own application, use [`mount`][keel.service.mount]; to run it, ``keel serve``).

    Args:
        agent_for: the agent of a tenant (made once per tenant, on shared stores).
        keys: the API keys.
        traces: the trace store the agents write to (``/v1/runs``).
        max_body_bytes: larger request bodies get 413 (bytes are counted as they arrive,
            chunked or not; no more than this is read).
        body_timeout_s: a body that has not arrived whole within this time gets 408.
        key_cache_s: how long a verified key is trusted without a look-up (a revoked key
            stops working within this time).
        on_shutdown: awaited when the server stops (close the agents' stores there), or
            when its start-up fails (``on_startup``, or ``ready`` with another error than
            a store's).
        on_startup: awaited once before the server takes traffic (start the agents' MCP
            servers there); what it raises fails the start-up.
        metrics_token: the operator's token for ``/metrics`` (Prometheus text format); the
            metrics name tenants, so without a token the route does not exist.
        tenants: the tenants whose agents exist (their death-spiral indicators are exported).
        rate_limiter: requests per key and minute; over it, 429 with ``Retry-After``.
        drain: shared with a [`DrainingServer`][keel.service.DrainingServer]: while it
            drains, new turns get 503 and the turns in flight are counted until they end.
        ready: awaited by ``/ready`` (and once at start-up, to warm what it opens); it raises
            [`BackendUnavailableError`][keel.errors.BackendUnavailableError] while a store
            does not answer.
        ui: serve the web trace viewer at ``/ui`` (it signs in with the same API keys).
        vault: the agents' PII vault: reads of history show a user key its user's values,
            and ``POST /v1/privacy/forget`` erases a user's (None: no vault, and that route
            answers 404).
        operators_see_values: a tenant's operator key reads its users' values too (without
            it, placeholders).
        approvals: the approvals queue the agents write to (``/v1/approvals``; without it,
            those routes answer 404).
        carry_out_every_s: with a queue, every this many seconds a background task carries
            out what was decided elsewhere (``keel approvals approve``): the parked turns go
            on, as ``agent.carry_out_decisions()`` does (None: never).
        erase_user: erases ``(tenant, user, requested_by)`` from every store, for ``POST
            /v1/privacy/erase`` (None: that route answers 404).
        pruner: applies memory's retention policies every interval, in the background.

    Returns:
        The app; serve it with uvicorn (or ``DrainingServer``).
    """
    carrier = (
        None
        if approvals is None or carry_out_every_s is None
        else service_carrier(agent_for, approvals, every_s=carry_out_every_s, drain=drain)
    )

    app = FastAPI(
        lifespan=_lifespan(ready, on_shutdown, carrier, pruner, on_startup),
        title="keel",
        description="An agent runtime: sessions, turns (JSON or server-sent events), runs.",
        version="1",
    )
    context = ServiceContext(
        agent_for=agent_for,
        keys=CachedKeys(keys.caller_of, key_cache_s, keys.acaller_of),
        traces=traces,
        metrics_token=metrics_token,
        tenants=tenants,
        rate_limiter=rate_limiter,
        drain=drain,
        ready=ready,
        privacy=Disclosure(vault, operators_see_values),
        approvals=approvals,
        carry_out_every_s=None if carrier is None else carrier.every_s,
        erase_user=erase_user,
    )
    app.state.keel = context
    install_error_handlers(app)
    app.add_middleware(
        Gate,
        context=context,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        routes=[route for router in _ROUTERS for route in router.routes],
    )
    for router in _ROUTERS:
        # The OpenAI routes and the probes keep OpenAI's and load balancers' leniency.
        lenient = router in (routes.chat.router, routes.models.router, routes.ops.router)
        app.include_router(router, dependencies=None if lenient else [Depends(known_query)])
    if ui:
        # Not at the top: keel.ui imports keel.service's route helpers (a cycle otherwise).
        from keel.ui import mount_ui

        # The viewer shows a whole tenant: it signs in with the tenant's operator key only.
        mount_ui(app, agent_for, keys, traces)
    return app
