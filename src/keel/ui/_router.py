"""The web trace viewer's pages, mounted on the service's app at ``/ui``.

Sign-in is a tenant's operator API key, entered once: it opens a server-side session (an
opaque random token in an HttpOnly, SameSite=Strict cookie, only its hash stored next to the
keys, so every worker knows it), which ends after ``SESSION_LIFETIME_S``, on sign-out, or when
its key is revoked; the key itself never reaches the cookie. Every page is scoped to that key's
tenant exactly as the API is (another tenant's run or session is a 404 like one that does not
exist). Pages are rendered on the server with Jinja2 (autoescaped); charts and graphs are
inline SVG; forms post back (revert, resolve) and go through the same compare-and-set and
journal calls as the API; the approvals page (``_approvals.py``) decides through the agent, as
the API does. The sign-in and what every page shares are in ``_viewer.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from keel._bridge import run_blocking
from keel.errors import ConflictError, SessionBusyError, StateError
from keel.memory import MemoryFilter, Scope
from keel.messages import Message
from keel.service._access import path_session_id, revert_holding_lease
from keel.service._context import context_of
from keel.service._ids import RawPathRoute, Text
from keel.tracing import RUN_STATUSES, Run, RunDetail, RunQuery, TraceStore
from keel.ui._approvals import router as approvals_router
from keel.ui._diff import field_diff
from keel.ui._render import indicator_series, line_chart, machine_graph, token_bar
from keel.ui._viewer import (
    COOKIE,
    SESSION_LIFETIME_S,
    Missing,
    SignInFirst,
    Viewer,
    current_viewer,
    signed_in_tenant,
)
from keel.ui._views import (
    json_view,
    other_attributes,
    prompt_messages,
    search_runs,
    session_turns,
    timeline,
)

if TYPE_CHECKING:
    from keel.runtime import Agent
    from keel.service._keys import APIKeys
    from keel.state import MachinePosition

__all__ = ["mount_ui"]

_PAGE = 25
_CHECKPOINTS_PAGE = 20
"""Checkpoints per page of the session's checkpoint table."""
_USERS_SCAN = 1_000
"""Runs read to list the users the memory page offers when none is chosen."""
_STATUSES = RUN_STATUSES

SHORTEST_RUN_PREFIX = 8
"""The fewest characters of a run id that name it in a URL (the CLI prints 12)."""

_PREFIX_SCAN = 50
"""At most this many runs of every tenant are read for one prefix (ids are random hex: two
that share 8 characters are already rare)."""


def _since(period: str | None) -> datetime | None:
    spans = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
    return datetime.now(UTC) - spans[period] if period in spans else None


# Matched as sent: a session id spelled team%2Falpha stays one path segment.
router = APIRouter(include_in_schema=False, route_class=RawPathRoute)


@router.get("/ui")
async def home() -> Response:
    return RedirectResponse("/ui/runs", status_code=303)


@router.get("/ui/login")
async def login_form(
    request: Request, next: str = "/ui/runs", viewer: Viewer = Depends(current_viewer)
) -> Response:
    return viewer.page("login.html", request, next=next, error=None, tenant=None)


@router.post("/ui/login")
async def login(
    request: Request,
    key: str = Form(max_length=512),
    next: str = Form("/ui/runs"),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    keys = viewer.keys
    # Verified afresh (no key cache): a key revoked a moment ago opens no session.
    caller = await keys.acaller_of(key.strip())
    if caller is None or not caller.operator:
        return viewer.page(
            "login.html",
            request,
            status=401,
            next=next,
            error="Unknown or revoked key (the viewer takes a tenant's operator key).",
            tenant=None,
        )
    key_id = caller.key_id
    token = await keys.acall(lambda: keys.start_session(key_id, SESSION_LIFETIME_S))
    target = next if next.startswith("/ui") else "/ui/runs"
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="strict",
        path="/ui",
        max_age=SESSION_LIFETIME_S,
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/ui/logout")
async def logout(request: Request, viewer: Viewer = Depends(current_viewer)) -> Response:
    token = request.cookies.get(COOKIE)
    if token:
        keys = viewer.keys
        await keys.acall(lambda: keys.end_session(token))
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/ui/runs")
async def runs(
    request: Request,
    session: str | None = Query(default=None, max_length=256),
    status: str | None = Query(default=None),
    min_steps: int | None = Query(default=None, ge=0),
    tool_error: str | None = Query(default=None),
    since: str | None = Query(default=None),
    until: datetime | None = None,
    text: str | None = Query(default=None, max_length=500),
    tool: str | None = Query(default=None, max_length=256),
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    query = RunQuery(
        tenant_id=tenant,
        session_id=session or None,
        status=status if status in _STATUSES else None,
        min_steps=min_steps,
        tool_error={"yes": True, "no": False}.get(tool_error or ""),
        since=_since(since),
        until=until,
        limit=_PAGE + 1,
    )
    traces = viewer.traces
    text, tool = (text or "").strip(), (tool or "").strip()
    stopped = False
    if text or tool:

        def tool_runs() -> set[str]:
            metrics = traces.step_metrics(
                session_id=query.session_id, since=query.since, tenant_id=tenant
            )
            return {m.run_id for m in metrics if m.kind == "tool" and m.name == tool}

        found, stopped = await run_blocking(
            search_runs, traces, query, text, tool, tool_runs, _PAGE + 1
        )
    else:
        found = await run_blocking(traces.list_runs, query)
    shown, more = found[:_PAGE], len(found) > _PAGE
    filters = {
        "text": text,
        "tool": tool,
        "session": session or "",
        "status": status or "",
        "min_steps": "" if min_steps is None else str(min_steps),
        "tool_error": tool_error or "",
        "since": since or "",
    }
    older = None
    if more:
        kept = {name: value for name, value in filters.items() if value}
        older = "/ui/runs?" + urlencode({**kept, "until": shown[-1].started_at.isoformat()})
    return viewer.page(
        "runs.html",
        request,
        tenant=tenant,
        runs=shown,
        filters=filters,
        statuses=_STATUSES,
        older=older,
        stopped=stopped,
        live=any(run.status == "running" for run in shown),
    )


def _tenant_runs(traces: TraceStore, tenant: str, run_id: str) -> list[Run]:
    """The tenant's runs that ``run_id`` names: the run with that id, or those it is a prefix
    of (at least ``SHORTEST_RUN_PREFIX`` characters), as ``keel runs show`` resolves the short
    ids it prints. Another tenant's runs are not counted: they neither match nor make a
    prefix ambiguous."""
    exact = traces.get_run(run_id)
    if exact is not None:
        return [exact] if exact.tenant_id == tenant else []
    if len(run_id) < SHORTEST_RUN_PREFIX:
        return []
    found = [traces.get_run(i) for i in traces.run_ids_starting_with(run_id, limit=_PREFIX_SCAN)]
    return [run for run in found if run is not None and run.tenant_id == tenant]


@router.get("/ui/runs/{run_id}")
async def run(
    request: Request,
    run_id: str,
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    named = await run_blocking(_tenant_runs, viewer.traces, tenant, run_id)
    if len(named) > 1:
        # 300 Multiple Choices: the page lists them, each a link to its full id.
        return viewer.page(
            "ambiguous.html", request, status=300, tenant=tenant, prefix=run_id, runs=named
        )
    detail = await run_blocking(viewer.traces.get_run_detail, named[0].run_id) if named else None
    if detail is None:
        raise Missing
    session_id = detail.run.session_id
    prefix = f"{tenant}/"
    stored = await _stored_messages(
        viewer.agent_for(tenant), session_id.removeprefix(prefix), detail
    )
    return viewer.page(
        "run.html",
        request,
        tenant=tenant,
        run=detail.run,
        nodes=detail.tree(),
        bar=token_bar,
        prompt=lambda step: prompt_messages(step, stored.get(step.state_version)),
        json_view=json_view,
        other_attributes=other_attributes,
        session=session_id[len(prefix) :] if session_id.startswith(prefix) else session_id,
        live=detail.run.status == "running",
    )


async def _stored_messages(
    agent: Agent, session_id: str, detail: RunDetail
) -> dict[int | None, list[Message]]:
    """The session's messages at each checkpoint a model step of ``detail`` names: a step's
    trace names the turns it was sent by their positions there."""
    key = agent.session_key(session_id)
    versions = {
        step.state_version
        for step in detail.steps
        if step.kind == "model"
        and any("messages" in entry for entry in step.attributes.get("prompt") or ())
    }
    stored: dict[int | None, list[Message]] = {}
    for version in versions:
        try:
            if version is None:
                checkpoint = await agent.state.aget(key)
            else:
                checkpoint = await agent.state.aat(key, version)
        except StateError:
            continue
        if checkpoint is not None:
            stored[version] = list(checkpoint.state.messages)
    return stored


@router.get("/ui/runs/{run_id}/timeline")
async def run_timeline(
    request: Request,
    run_id: str,
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    named = await run_blocking(_tenant_runs, viewer.traces, tenant, run_id)
    detail = (
        await run_blocking(viewer.traces.get_run_detail, named[0].run_id)
        if len(named) == 1
        else None
    )
    if detail is None:
        raise Missing
    session_id = detail.run.session_id
    prefix = f"{tenant}/"
    agent = viewer.agent_for(tenant)
    key = agent.session_key(session_id.removeprefix(prefix))
    history = await agent.state.ahistory(key, limit=200)
    marks = [(info.created_at, f"checkpoint v{info.version} ({info.reason})") for info in history]
    return viewer.page(
        "timeline.html",
        request,
        tenant=tenant,
        run=detail.run,
        timeline=timeline(detail, marks),
        session=session_id[len(prefix) :] if session_id.startswith(prefix) else session_id,
        live=detail.run.status == "running",
    )


def _workflow_graph(agent: Agent, position: MachinePosition | None) -> str | None:
    """The workflow's graph with the path taken, or only the path when this server does not
    hold the workflow's definition."""
    if agent.machine is not None:
        machine = agent.machine
        return machine_graph(
            list(machine.states),
            [(t.source, t.target, t.description) for t in machine.transitions],
            machine.initial,
            position.path if position is not None else [],
            position.state if position is not None else None,
        )
    if position is not None and position.path:
        path = position.path
        return machine_graph(
            list(dict.fromkeys(path)),
            [(a, b, "") for a, b in itertools.pairwise(path)],
            path[0],
            path,
            position.state,
        )
    return None


async def _session_view(
    viewer: Viewer,
    request: Request,
    tenant: str,
    session_id: str,
    page: int = 1,
    **extra: Any,
) -> HTMLResponse:
    agent = viewer.agent_for(tenant)
    key = agent.session_key(session_id)
    checkpoint = await agent.state.aget(key)
    if checkpoint is None:
        raise Missing
    # The newest versions first, a page at a time: the table no longer pushes the rest down.
    wanted = page * _CHECKPOINTS_PAGE + 1
    history = await agent.state.ahistory(key, limit=wanted)
    shown = history[(page - 1) * _CHECKPOINTS_PAGE : page * _CHECKPOINTS_PAGE]
    position = checkpoint.state.machine
    in_doubt, journal, approvals = [], [], []
    if agent.journal is not None:
        in_doubt = await run_blocking(agent.journal.in_doubt, key)
        journal = await run_blocking(agent.journal.entries, key)
    queue = context_of(request).approvals
    if queue is not None:
        approvals = await queue.alist(
            tenant,
            session_id=key,
            statuses=("pending", "approved", "rejected", "expired", "cancelled"),
        )
    runs: list[Run] = []
    # A run's trace names its session by the store key, or by the id the application used.
    for name in dict.fromkeys([key, session_id]):
        query = RunQuery(tenant_id=tenant, session_id=name, limit=200)
        runs += await run_blocking(viewer.traces.list_runs, query)
    graph = await run_blocking(_workflow_graph, agent, position)
    return viewer.page(
        "session.html",
        request,
        tenant=tenant,
        session_id=session_id,
        checkpoint=checkpoint,
        history=shown,
        versions=[info.version for info in history],
        page=page,
        more=len(history) > page * _CHECKPOINTS_PAGE,
        graph=graph,
        position=position,
        in_doubt=in_doubt,
        turns=session_turns(runs, journal, approvals),
        json_view=json_view,
        user=checkpoint.state.runtime.user_id,
        **extra,
    )


@router.get("/ui/sessions/{session_id}")
async def session(
    request: Request,
    session_id: str = Depends(path_session_id),
    a: int | None = Query(default=None, ge=1),
    b: int | None = Query(default=None, ge=1),
    page: int = Query(default=1, ge=1, le=10_000),
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    diff = None
    if a is not None and b is not None:
        agent = viewer.agent_for(tenant)
        key = agent.session_key(session_id)
        try:
            older = await agent.state.aat(key, min(a, b))
            newer = await agent.state.aat(key, max(a, b))
        except StateError:
            raise Missing from None
        diff = field_diff(older.state.model_dump(mode="json"), newer.state.model_dump(mode="json"))
    return await _session_view(
        viewer,
        request,
        tenant,
        session_id,
        page=page,
        diff=diff,
        a=a,
        b=b,
    )


@router.post("/ui/sessions/{session_id}/revert")
async def revert(
    request: Request,
    session_id: str = Depends(path_session_id),
    version: int = Form(ge=1),
    expected_version: int = Form(ge=1),
    confirm: str | None = Form(default=None),
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    if confirm != "yes":
        notice = "Tick the confirmation to revert."
        return await _session_view(viewer, request, tenant, session_id, notice=notice, diff=None)
    agent = viewer.agent_for(tenant)
    if await agent.state.aget(agent.session_key(session_id)) is None:
        raise Missing
    try:
        done = await revert_holding_lease(
            agent, session_id, expected_version=expected_version, to_version=version
        )
        notice = f"Reverted to version {version}: the session is now at version {done.version}."
    except SessionBusyError:
        notice = "A turn is running on this session: nothing was reverted; try again."
    except ConflictError:
        notice = "The session moved on since this page was loaded: nothing was reverted."
    except StateError:
        raise Missing from None
    return await _session_view(viewer, request, tenant, session_id, notice=notice, diff=None)


@router.post("/ui/sessions/{session_id}/resolve")
async def resolve(
    request: Request,
    session_id: str = Depends(path_session_id),
    key: str = Form(max_length=256),
    ok: str = Form(),
    content: Text = Form(min_length=1, max_length=10_000),  # noqa: B008 - FastAPI form field
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    agent = viewer.agent_for(tenant)
    journal = agent.journal
    session_key = agent.session_key(session_id)
    entry = None if journal is None else await journal.aget(key)
    if journal is None or entry is None or entry.session_id != session_key:
        raise Missing
    await run_blocking(journal.resolve, key, ok=ok == "yes", content=content)
    notice = f"Resolved {entry.tool} call."
    return await _session_view(viewer, request, tenant, session_id, notice=notice, diff=None)


@router.get("/ui/memory")
async def memory(
    request: Request,
    user: str | None = Query(default=None, max_length=256),
    q: str | None = Query(default=None, max_length=2_000),
    budget: int = Query(default=600, ge=50, le=20_000),
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    agent = viewer.agent_for(tenant)
    store = agent.memory
    records, hits, packed, histories = [], [], None, {}
    if store is not None and user:
        scope = Scope(tenant_id=tenant, user_id=user)
        records = await run_blocking(store.store.list_records, scope, MemoryFilter(), limit=200)
        for record in records:
            if record.subject and record.attribute and record.valid_to is not None:
                chain = (record.subject, record.attribute)
                if chain not in histories:
                    histories[chain] = await run_blocking(store.fact_history, scope, *chain)
        if q:
            hits = await store.asearch(q, scope=scope, k=10)
            packed = await store.aretrieve(q, scope=scope, budget_tokens=budget)
    users: list[str] = []
    if store is not None and not user:
        # The users the tenant's runs served, to choose from (the store keeps no user list).
        seen = await run_blocking(
            viewer.traces.list_runs, RunQuery(tenant_id=tenant, limit=_USERS_SCAN)
        )
        users = sorted({run.user_id for run in seen if run.user_id})
    return viewer.page(
        "memory.html",
        request,
        tenant=tenant,
        enabled=store is not None,
        user=user or "",
        q=q or "",
        budget=budget,
        records=records,
        histories=histories,
        hits=hits,
        packed=packed,
        users=users,
    )


@router.get("/ui/health")
async def health(
    request: Request,
    session: str | None = Query(default=None, max_length=256),
    since: str | None = Query(default="24h"),
    tenant: str = Depends(signed_in_tenant),
    viewer: Viewer = Depends(current_viewer),
) -> Response:
    agent = viewer.agent_for(tenant)
    session_key = agent.session_key(session) if session else None
    window = _since(since)
    traces = viewer.traces
    metrics = await run_blocking(
        lambda: traces.step_metrics(session_id=session_key, since=window, tenant_id=tenant)
    )
    stats = await run_blocking(
        lambda: traces.session_stats(session_id=session_key, since=window, tenant_id=tenant)
    )
    charts = [(series, line_chart(series)) for series in indicator_series(metrics)]
    return viewer.page(
        "health.html",
        request,
        tenant=tenant,
        session=session or "",
        since=since or "",
        charts=charts,
        stats=stats,
        agent_name=agent.name,
    )


def mount_ui(
    app: FastAPI, agent_for: Callable[[str], Agent], keys: APIKeys, traces: TraceStore
) -> None:
    """Serve the viewer at ``/ui`` on ``app``: it signs in with a tenant's operator key from
    ``keys``, and keeps its sessions there."""
    viewer = Viewer(agent_for, keys, traces)
    app.state.keel_viewer = viewer
    app.mount(
        "/ui/static", StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static"
    )

    async def sign_in_first(request: Request, exc: Exception) -> Response:
        target = urlencode({"next": str(request.url.path)})
        return RedirectResponse(f"/ui/login?{target}", status_code=303)

    async def missing(request: Request, exc: Exception) -> Response:
        return viewer.page("missing.html", request, status=404, tenant=None)

    async def favicon() -> Response:
        return RedirectResponse("/ui/static/favicon.svg", status_code=301)

    # Browsers ask the site's root for its icon; the viewer's is the service's.
    app.add_api_route("/favicon.ico", favicon, include_in_schema=False)
    app.add_exception_handler(SignInFirst, sign_in_first)
    app.add_exception_handler(Missing, missing)
    app.include_router(router)
    app.include_router(approvals_router)
