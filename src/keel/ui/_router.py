"""The web trace viewer's pages, mounted on the service's app at ``/ui``.

Sign-in is the service's own API key, entered once and kept in an HttpOnly, SameSite=Strict
cookie; every page is scoped to that key's tenant exactly as the API is (another tenant's run
or session is a 404 like one that does not exist). Pages are rendered on the server with
Jinja2 (autoescaped); charts and graphs are inline SVG; forms post back (revert, resolve)
and go through the same compare-and-set and journal calls as the API.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from fastapi import FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, PackageLoader, select_autoescape

from keel.errors import ConflictError, StateError
from keel.tracing import RUN_STATUSES, RunQuery, TraceStore
from keel.ui._render import indicator_series, line_chart, machine_graph, state_diff, token_bar

if TYPE_CHECKING:
    from keel.runtime import Agent

__all__ = ["COOKIE", "mount_ui"]

COOKIE = "keel_ui_key"
"""The cookie holding the signed-in API key (HttpOnly, SameSite=Strict, path /ui)."""

_PAGE = 25
_STATUSES = RUN_STATUSES


class _SignIn(Exception):
    """No valid key: the page sends the browser to the sign-in form."""


class _Missing(Exception):
    """Not found, or the tenant's to see."""


def _environment() -> Environment:
    environment = Environment(
        loader=PackageLoader("keel.ui", "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["when"] = lambda value: (
        "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    )
    environment.filters["ms"] = lambda value: "" if value is None else f"{value:.0f} ms"
    return environment


def _since(period: str | None) -> datetime | None:
    spans = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
    return datetime.now(UTC) - spans[period] if period in spans else None


def mount_ui(
    app: FastAPI,
    agent_for: Callable[[str], Agent],
    tenant_of_key: Callable[[str], str | None],
    traces: TraceStore,
) -> None:
    """Serve the viewer at ``/ui`` on ``app``."""
    templates = _environment()
    app.mount(
        "/ui/static", StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static"
    )

    def page(name: str, request: Request, status: int = 200, **values: Any) -> HTMLResponse:
        html = templates.get_template(name).render(request=request, **values)
        return HTMLResponse(html, status_code=status)

    def tenant_of(request: Request) -> str:
        key = request.cookies.get(COOKIE)
        tenant = tenant_of_key(key) if key else None
        if tenant is None:
            raise _SignIn
        return tenant

    @app.exception_handler(_SignIn)
    async def sign_in_first(request: Request, exc: _SignIn) -> Response:
        target = urlencode({"next": str(request.url.path)})
        return RedirectResponse(f"/ui/login?{target}", status_code=303)

    @app.exception_handler(_Missing)
    async def missing(request: Request, exc: _Missing) -> Response:
        return page("missing.html", request, status=404, tenant=None)

    @app.get("/ui", include_in_schema=False)
    async def home() -> Response:
        return RedirectResponse("/ui/runs", status_code=303)

    @app.get("/ui/login", include_in_schema=False)
    async def login_form(request: Request, next: str = "/ui/runs") -> Response:
        return page("login.html", request, next=next, error=None, tenant=None)

    @app.post("/ui/login", include_in_schema=False)
    async def login(
        request: Request, key: str = Form(max_length=512), next: str = Form("/ui/runs")
    ) -> Response:
        if tenant_of_key(key.strip()) is None:
            return page(
                "login.html",
                request,
                status=401,
                next=next,
                error="Unknown or revoked key.",
                tenant=None,
            )
        target = next if next.startswith("/ui") else "/ui/runs"
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE, key.strip(), httponly=True, samesite="strict", path="/ui", max_age=86_400
        )
        return response

    @app.post("/ui/logout", include_in_schema=False)
    async def logout() -> Response:
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    @app.get("/ui/runs", include_in_schema=False)
    async def runs(
        request: Request,
        session: str | None = Query(default=None, max_length=256),
        status: str | None = Query(default=None),
        min_steps: int | None = Query(default=None, ge=0),
        tool_error: str | None = Query(default=None),
        since: str | None = Query(default=None),
        until: datetime | None = None,
    ) -> Response:
        tenant = tenant_of(request)
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
        found = await asyncio.to_thread(traces.list_runs, query)
        shown, more = found[:_PAGE], len(found) > _PAGE
        filters = {
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
        return page(
            "runs.html",
            request,
            tenant=tenant,
            runs=shown,
            filters=filters,
            statuses=_STATUSES,
            older=older,
            live=any(run.status == "running" for run in shown),
        )

    @app.get("/ui/runs/{run_id}", include_in_schema=False)
    async def run(request: Request, run_id: str) -> Response:
        tenant = tenant_of(request)
        detail = await asyncio.to_thread(traces.get_run_detail, run_id)
        if detail is None or detail.run.tenant_id != tenant:
            raise _Missing
        session_id = detail.run.session_id
        prefix = f"{tenant}/"
        return page(
            "run.html",
            request,
            tenant=tenant,
            run=detail.run,
            nodes=detail.tree(),
            bar=token_bar,
            session=session_id[len(prefix) :] if session_id.startswith(prefix) else session_id,
            live=detail.run.status == "running",
        )

    async def session_view(
        request: Request, tenant: str, session_id: str, **extra: Any
    ) -> HTMLResponse:
        agent = agent_for(tenant)
        key = agent.session_key(session_id)
        checkpoint = await agent.state.aget(key)
        if checkpoint is None:
            raise _Missing
        history = await agent.state.ahistory(key, limit=200)
        graph = None
        position = checkpoint.state.machine
        if agent.machine is not None:
            machine = agent.machine
            graph = machine_graph(
                list(machine.states),
                [(t.source, t.target, t.description) for t in machine.transitions],
                machine.initial,
                position.path if position is not None else [],
                position.state if position is not None else None,
            )
        elif position is not None and position.path:
            # This server does not hold the workflow's definition: draw the path taken.
            path = position.path
            graph = machine_graph(
                list(dict.fromkeys(path)),
                [(a, b, "") for a, b in itertools.pairwise(path)],
                path[0],
                path,
                position.state,
            )
        in_doubt = []
        if agent.journal is not None:
            in_doubt = await asyncio.to_thread(agent.journal.in_doubt, key)
        return page(
            "session.html",
            request,
            tenant=tenant,
            session_id=session_id,
            checkpoint=checkpoint,
            history=history,
            graph=graph,
            position=position,
            in_doubt=in_doubt,
            user=checkpoint.state.runtime.user_id,
            **extra,
        )

    @app.get("/ui/sessions/{session_id}", include_in_schema=False)
    async def session(
        request: Request,
        session_id: str,
        a: int | None = Query(default=None, ge=1),
        b: int | None = Query(default=None, ge=1),
    ) -> Response:
        tenant = tenant_of(request)
        diff = None
        if a is not None and b is not None:
            agent = agent_for(tenant)
            key = agent.session_key(session_id)
            try:
                older = await agent.state.aat(key, min(a, b))
                newer = await agent.state.aat(key, max(a, b))
            except StateError:
                raise _Missing from None
            diff = state_diff(
                older.state.model_dump(mode="json"),
                newer.state.model_dump(mode="json"),
                f"version {older.version}",
                f"version {newer.version}",
            )
        return await session_view(request, tenant, session_id, diff=diff, a=a, b=b)

    @app.post("/ui/sessions/{session_id}/revert", include_in_schema=False)
    async def revert(
        request: Request,
        session_id: str,
        version: int = Form(ge=1),
        expected_version: int = Form(ge=1),
        confirm: str | None = Form(default=None),
    ) -> Response:
        tenant = tenant_of(request)
        if confirm != "yes":
            return await session_view(
                request, tenant, session_id, notice="Tick the confirmation to revert.", diff=None
            )
        agent = agent_for(tenant)
        key = agent.session_key(session_id)
        if await agent.state.aget(key) is None:
            raise _Missing
        try:
            done = await agent.state.arevert(
                key, expected_version=expected_version, to_version=version
            )
        except ConflictError:
            return await session_view(
                request,
                tenant,
                session_id,
                notice="The session moved on since this page was loaded: nothing was reverted.",
                diff=None,
            )
        except StateError:
            raise _Missing from None
        notice = f"Reverted to version {version}: the session is now at version {done.version}."
        return await session_view(request, tenant, session_id, notice=notice, diff=None)

    @app.post("/ui/sessions/{session_id}/resolve", include_in_schema=False)
    async def resolve(
        request: Request,
        session_id: str,
        key: str = Form(max_length=256),
        ok: str = Form(),
        content: str = Form(min_length=1, max_length=10_000),
    ) -> Response:
        tenant = tenant_of(request)
        agent = agent_for(tenant)
        journal = agent.journal
        session_key = agent.session_key(session_id)
        entry = None if journal is None else await journal.aget(key)
        if journal is None or entry is None or entry.session_id != session_key:
            raise _Missing
        await asyncio.to_thread(journal.resolve, key, ok=ok == "yes", content=content)
        return await session_view(
            request, tenant, session_id, notice=f"Resolved {entry.tool} call.", diff=None
        )

    @app.get("/ui/memory", include_in_schema=False)
    async def memory(
        request: Request,
        user: str | None = Query(default=None, max_length=256),
        q: str | None = Query(default=None, max_length=2_000),
        budget: int = Query(default=600, ge=50, le=20_000),
    ) -> Response:
        from keel.memory import MemoryFilter, Scope

        tenant = tenant_of(request)
        agent = agent_for(tenant)
        store = None if agent.memory is None else agent.memory
        records, hits, packed, histories = [], [], None, {}
        if store is not None and user:
            scope = Scope(tenant_id=tenant, user_id=user)
            records = await asyncio.to_thread(
                store.store.list_records, scope, MemoryFilter(), limit=200
            )
            for record in records:
                if record.subject and record.attribute and record.valid_to is not None:
                    chain = (record.subject, record.attribute)
                    if chain not in histories:
                        histories[chain] = await asyncio.to_thread(
                            store.fact_history, scope, *chain
                        )
            if q:
                hits = await store.asearch(q, scope=scope, k=10)
                packed = await store.aretrieve(q, scope=scope, budget_tokens=budget)
        return page(
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
        )

    @app.get("/ui/health", include_in_schema=False)
    async def health(
        request: Request,
        session: str | None = Query(default=None, max_length=256),
        since: str | None = Query(default="24h"),
    ) -> Response:
        tenant = tenant_of(request)
        agent = agent_for(tenant)
        session_key = agent.session_key(session) if session else None
        window = _since(since)
        metrics = await asyncio.to_thread(
            lambda: traces.step_metrics(session_id=session_key, since=window, tenant_id=tenant)
        )
        stats = await asyncio.to_thread(
            lambda: traces.session_stats(session_id=session_key, since=window, tenant_id=tenant)
        )
        charts = [(series, line_chart(series)) for series in indicator_series(metrics)]
        return page(
            "health.html",
            request,
            tenant=tenant,
            session=session or "",
            since=since or "",
            charts=charts,
            stats=stats,
            agent_name=agent.name,
        )
