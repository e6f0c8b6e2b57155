"""Users within a tenant: what the request's key may reach.

A user key reaches only its user's sessions, memory and runs: another user's is 404 (as if it
did not exist), and naming another user in a request is 403. A tenant-wide key is the tenant's
operator key: it reaches every user, and each read of a user's data is logged on
``keel.service.access`` at INFO (who read whose what; never a key or a body).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import Depends, Request

from keel.service._context import limited_tenant
from keel.service._errors import HTTPError
from keel.service._ids import check_user_id, session_id_from_wire

if TYPE_CHECKING:
    from keel.runtime import Agent
    from keel.service._keys import Caller
    from keel.state import AgentState, Checkpoint

__all__ = [
    "access_log",
    "caller",
    "chat_party",
    "owned_checkpoint",
    "path_session_id",
    "read_of",
    "revert_holding_lease",
    "session_read",
    "user_of",
]

access_log = logging.getLogger("keel.service.access")


async def caller(request: Request, tenant_id: str = Depends(limited_tenant)) -> Caller:
    """Who the request's key speaks for, once the key's rate limit let it through."""
    found: Caller = request.state.keel_caller
    return found


def path_session_id(session_id: str) -> str:
    """The session the path names (its segment percent-decoded; 422 outside the grammar)."""
    return session_id_from_wire(session_id)


def user_of(who: Caller, user_id: str | None) -> str:
    """``user_id`` when the key may act for that user; 403 when a user key names another,
    422 when an operator key names none."""
    if user_id is None:
        raise HTTPError(422, "ValidationError", "user: an operator key names the user")
    if who.user_id is not None and who.user_id != user_id:
        raise HTTPError(403, "Forbidden", "this API key acts only for its own user")
    return user_id


def read_of(who: Caller, owner: str | None, what: str) -> None:
    """Let ``who`` read ``what`` of ``owner``'s: 404 for another user's key; an operator's
    read of a user's data goes to the access log."""
    if who.user_id is not None:
        if owner != who.user_id:
            raise HTTPError(404, "NotFound", "not found")
        return
    if owner is not None:
        access_log.info(
            "operator key %s read %s of user %s",
            who.key_id,
            what,
            owner,
            extra={
                "tenant": who.tenant_id,
                "key_id": who.key_id,
                "read": what,
                "of_user": owner,
            },
        )


def chat_party(
    request: Request, session: str, user: str, *, user_from_header: bool
) -> tuple[str, str]:
    """The session and user a chat completion names: the session spelled as every session id
    on the wire is (percent-encoded beyond the grammar's characters, in a header or the body),
    an ``X-Keel-User`` header likewise; a user key's own user only (403 for another)."""
    session_id = session_id_from_wire(session, "session")
    user_id = session_id_from_wire(user, "X-Keel-User") if user_from_header else user
    try:
        check_user_id(user_id)
    except ValueError as exc:
        raise HTTPError(422, "ValidationError", f"user: {exc}") from None
    who: Caller = request.state.keel_caller
    return session_id, user_of(who, user_id)


async def revert_holding_lease(
    agent: Agent, session_id: str, *, expected_version: int, to_version: int
) -> Checkpoint[AgentState]:
    """Revert the session while holding its lease ([`Agent.revert`][]): a turn running on it
    makes this [`SessionBusyError`][keel.errors.SessionBusyError] (409), and nothing changes."""
    return await agent.revert(session_id, expected_version=expected_version, to_version=to_version)


async def owned_checkpoint(
    agent: Agent, who: Caller, session_id: str, what: str
) -> Checkpoint[AgentState]:
    """The session's newest checkpoint, when ``who`` may read it (404 otherwise)."""
    checkpoint = await session_read(agent, who, session_id, what)
    if checkpoint is None:
        raise HTTPError(404, "NotFound", "not found")
    return checkpoint


async def session_read(
    agent: Agent, who: Caller, session_id: str, what: str
) -> Checkpoint[AgentState] | None:
    """The session's newest checkpoint (None when it has none), when ``who`` may read what
    the session holds (404 for a user key and another user's session, or none)."""
    checkpoint = await agent.state.aget(agent.session_key(session_id))
    if checkpoint is not None and not agent.owns(checkpoint.state):
        raise HTTPError(404, "NotFound", "not found")
    owner = None if checkpoint is None else checkpoint.state.runtime.user_id
    read_of(who, owner, f"{what} of session {session_id!r}")
    return checkpoint
