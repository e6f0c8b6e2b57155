"""What every route of one app shares, built once by [`create_app`][] and
reached through the request (``request.app.state.keel``), as FastAPI's dependencies expect."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import Depends, Header, Request

from keel.service._errors import HTTPError, RateLimited
from keel.service._keys import bearer_key, key_id_of
from keel.service._logging import SERVICE_LOGGER, note_run, note_tenant
from keel.service._privacy import Disclosure

if TYPE_CHECKING:
    from keel.approvals import ApprovalStore
    from keel.memory import Memory
    from keel.runtime import Agent, AgentReply
    from keel.service._drain import Drain
    from keel.service._keys import CachedKeys, Caller
    from keel.service._limits import RateLimiter
    from keel.stores import ErasureReport
    from keel.tools import ToolJournal
    from keel.tracing import TraceStore

__all__ = [
    "ServiceContext",
    "authenticated_caller",
    "context_of",
    "journal_of",
    "limited_tenant",
    "memory_of",
    "tenant",
    "turn_id_of",
]


@dataclass
class ServiceContext:
    """The service's shared parts: the agents, the keys, the traces, limits and counters."""

    agent_for: Callable[[str], Agent]
    keys: CachedKeys
    traces: TraceStore
    metrics_token: str | None = None
    tenants: Callable[[], Iterable[str]] | None = None
    rate_limiter: RateLimiter | None = None
    drain: Drain | None = None
    ready: Callable[[], Awaitable[None]] | None = None
    privacy: Disclosure = field(default_factory=Disclosure)
    """The PII vault, and who reads values from it."""
    approvals: ApprovalStore | None = None
    """The queue of requests waiting for a person (``/v1/approvals``), if the service keeps one."""
    carry_out_every_s: float | None = None
    """How often the worker's background task carries out decisions made elsewhere (None:
    no task runs)."""
    erase_user: Callable[[str, str, str], Awaitable[ErasureReport]] | None = None
    """Erase ``(tenant, user, requested_by)`` from every store (``POST /v1/privacy/erase``;
    None: that route answers 404)."""
    requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """HTTP requests by method, route template and status."""
    turns: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Turns by tenant and how they ended."""

    def counted(self, tenant_id: str, reply: AgentReply) -> AgentReply:
        """Count a finished turn for ``/metrics`` (and name its run in the access log); the
        reply as a client is shown it (`told`)."""
        note_run(reply.run_id)
        self.turns[(tenant_id, reply.status)] += 1
        if not reply.error:
            return reply
        error = self.told(tenant_id, reply.error)
        if error == reply.error:
            return reply
        # The operator reads the error as it was: here, and in the run's trace.
        SERVICE_LOGGER.warning("run %s %s: %s", reply.run_id, reply.status, reply.error)
        return reply.model_copy(update={"error": error})

    def told_all(self, tenant_id: str, value: Any) -> Any:
        """`told` through a JSON value (a run's detail: its error and its steps' errors), where
        the address may be stored masked (its host an ``<IP_ADDRESS_1>``)."""
        endpoint = self.agent_for(tenant_id).model.endpoint
        if not endpoint:
            return value
        return _replaced(value, _stored_forms(endpoint))

    def told(self, tenant_id: str, text: str) -> str:
        """``text`` as a client is told it: the model server's address (an internal URL, in
        ``cannot reach http://10.0.0.5:8000/v1``) named only as "the model server"."""
        told: str = self.told_all(tenant_id, text)
        return told


def context_of(request: Request) -> ServiceContext:
    """The app's shared context (a dependency)."""
    context: ServiceContext = request.app.state.keel
    return context


async def authenticated_caller(context: ServiceContext, authorization: str | None) -> Caller:
    """Who an ``Authorization`` header's key speaks for (its tenant, and its one user for a
    user key); 401 without a valid key."""
    key = bearer_key(authorization)
    if key is None:
        raise HTTPError(401, "Unauthorized", "send Authorization: Bearer <API key>")
    found = await context.keys.acaller(key)
    if found is None:
        raise HTTPError(401, "Unauthorized", "unknown or revoked API key")
    note_tenant(found.tenant_id)
    return found


async def tenant(request: Request, authorization: str | None = Header(default=None)) -> str:
    """The tenant the request's API key names; 401 without a valid key."""
    found = await authenticated_caller(context_of(request), authorization)
    request.state.keel_caller = found  # who the key speaks for: keel.service._access.caller
    return found.tenant_id


async def limited_tenant(
    request: Request,
    tenant_id: str = Depends(tenant),
    authorization: str | None = Header(default=None),
) -> str:
    """The request's tenant, once the key's rate limit lets it through (429 otherwise). A key
    is counted by its id, however the header spells it (``bearer``, ``BEARER``, extra
    spaces): the same key is one count."""
    limiter = context_of(request).rate_limiter
    if limiter is not None:
        key = bearer_key(authorization) or ""
        wait = await limiter.check(key_id_of(key) or hashlib.sha256(key.encode()).hexdigest())
        if wait is not None:
            raise RateLimited(wait)
    return tenant_id


def journal_of(agent: Agent) -> ToolJournal:
    """The agent's tool journal; 404 when the service keeps none."""
    if agent.journal is None:
        raise HTTPError(404, "NotFound", "this service keeps no durable tool journal")
    return agent.journal


def memory_of(agent: Agent) -> Memory:
    """The agent's long-term memory; 404 when the service runs without one."""
    if agent.memory is None:
        raise HTTPError(404, "NotFound", "this service runs without long-term memory")
    return agent.memory


def turn_id_of(idempotency_key: str | None) -> str | None:
    """The agent's turn id for a request's ``Idempotency-Key`` (bounded, plain characters)."""
    if idempotency_key is None:
        return None
    return "idem-" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:40]


def _stored_forms(endpoint: str) -> re.Pattern[str]:
    """``endpoint`` as written, or with its host masked as a trace stores it."""
    host = urlsplit(endpoint).hostname or ""
    if not host or host not in endpoint:
        return re.compile(re.escape(endpoint))
    before, _, after = endpoint.partition(host)
    return re.compile(
        f"{re.escape(before)}(?:{re.escape(host)}|<[A-Z][A-Z0-9_]*_[0-9]+>){re.escape(after)}",
        re.IGNORECASE,
    )


def _replaced(value: Any, endpoint: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return endpoint.sub("the model server", value) if "/" in value else value
    if isinstance(value, dict):
        return {key: _replaced(item, endpoint) for key, item in value.items()}
    if isinstance(value, list):
        return [_replaced(item, endpoint) for item in value]
    return value
