"""What the viewer's pages share: the session cookie, the sign-in every page depends on, the
signed-in tenant, and the templates (``app.state.keel_viewer``). The runs, sessions and
memory pages (``_router.py``) and the approvals page (``_approvals.py``) both build on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, select_autoescape

from keel.service._ids import session_url
from keel.service._keys import Caller
from keel.tracing import TraceStore

if TYPE_CHECKING:
    from keel.runtime import Agent
    from keel.service._keys import APIKeys

__all__ = [
    "COOKIE",
    "SESSION_LIFETIME_S",
    "Missing",
    "SignInFirst",
    "Viewer",
    "current_viewer",
    "duration",
    "signed_in",
    "signed_in_tenant",
]

COOKIE = "keel_ui_session"
"""The cookie holding the viewer's session token (HttpOnly, SameSite=Strict, path /ui; Secure
over https): never the API key."""

SESSION_LIFETIME_S = 8 * 3600
"""How long a sign-in lasts (a working day); then the viewer asks for the key again."""


def duration(ms: float | None) -> str:
    """A duration for people, precise below a millisecond: ``0.042 ms``, ``3.17 ms``,
    ``85.2 ms``, ``1.48 s``, ``2 min 03 s``; empty when unknown."""
    if ms is None:
        return ""
    if ms < 1:
        return f"{ms:.3f} ms"
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.1f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.2f} s"
    minutes, seconds = divmod(ms / 1000, 60)
    return f"{minutes:.0f} min {seconds:02.0f} s"


class SignInFirst(Exception):
    """No valid key: the page sends the browser to the sign-in form."""


class Missing(Exception):
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
    environment.filters["session_url"] = session_url
    environment.filters["ms"] = duration
    environment.filters["n"] = lambda value: "" if value is None else f"{value:,}"
    environment.filters["epoch"] = lambda value: datetime.fromtimestamp(value, UTC).strftime(
        "%Y-%m-%d %H:%M:%S"
    )
    return environment


@dataclass
class Viewer:
    """What the viewer's pages share, on ``app.state.keel_viewer``."""

    agent_for: Callable[[str], Agent]
    keys: APIKeys
    traces: TraceStore
    templates: Environment = field(default_factory=_environment)

    def page(self, name: str, request: Request, status: int = 200, **values: Any) -> HTMLResponse:
        html = self.templates.get_template(name).render(request=request, **values)
        return HTMLResponse(html, status_code=status)


def current_viewer(request: Request) -> Viewer:
    """The viewer [`mount_ui`][keel.ui.mount_ui] put on the app."""
    viewer: Viewer = request.app.state.keel_viewer
    return viewer


async def signed_in(request: Request, viewer: Viewer = Depends(current_viewer)) -> Caller:
    """Who the browser's session speaks for (an operator key); without a live session, the
    browser is sent to sign in. Looked up on every request, never cached: a session ends the
    moment it is signed out, expires or its key is revoked."""
    token = request.cookies.get(COOKIE)
    keys = viewer.keys
    caller = await keys.acall(lambda: keys.session_caller(token)) if token else None
    if caller is None or not caller.operator:
        raise SignInFirst
    return caller


def signed_in_tenant(caller: Caller = Depends(signed_in)) -> str:
    """The signed-in key's tenant."""
    return caller.tenant_id
