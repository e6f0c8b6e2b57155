"""A user's sessions erased from a state backend: found by the owner each session records.

A backend stores checkpoints under keys and knows nothing of users. keel's agents key a session
``tenant/session`` (the tenant percent-encoded: `tenant_key_prefix`) and record its owner in
the state's ``runtime`` (``tenant_id``, ``user_id``, set on its first turn), so a user's sessions
are the keys under their tenant's prefix whose state names them. Those go whole: every
checkpoint, the head, and the session's lease.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from keel.errors import ExpiredError
from keel.state._backend import StateBackend
from keel.state._delta import replay

__all__ = [
    "LEASE_KEY_PREFIX",
    "StateErasure",
    "erase_user_sessions",
    "tenant_key_prefix",
    "user_session_keys",
]

LEASE_KEY_PREFIX = "session:"
"""A session's lease is the backend's lock ``session:<session key>`` (`StateStore.lock`)."""


def tenant_key_prefix(tenant_id: str) -> str:
    """The prefix of every session key of ``tenant_id``: ``keel.runtime.session_key`` writes
    ``<tenant percent-encoded>/<session>``, so no tenant's prefix starts another's keys."""
    return f"{quote(tenant_id, safe='')}/"


@dataclass(frozen=True)
class StateErasure:
    """What a user's erasure removed from a state backend."""

    sessions: tuple[str, ...] = ()
    """The session keys erased (the caller's other stores key their rows by them)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Rows (or keys) removed, by what they were: sessions, checkpoints, leases."""


def user_session_keys(
    backend: StateBackend,
    tenant_id: str,
    user_id: str,
    *,
    also: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """The user's sessions in ``backend``, and the keys of ``also`` (session keys found
    elsewhere: the user's traces, approvals, memory) that no stored session contradicts.

    The first list: every session of ``tenant_id`` whose state names ``user_id`` as its
    owner, expired ones included (read as of 1970, before any expiry). The second: the
    first, with the keys of ``also`` under the tenant's prefix whose session is gone (what a
    journal may still hold of them); never a session another user owns."""
    prefix = tenant_key_prefix(tenant_id)
    stored = backend.sessions_under(prefix)
    owned = [key for key in stored if _owner(backend, key, tenant_id, user_id) == "user"]
    held = set(stored)
    gone = [
        key
        for key in dict.fromkeys(also)
        if key.startswith(prefix)
        and key not in held
        and _owner(backend, key, tenant_id, user_id) == "absent"
    ]
    return owned, [*owned, *gone]


def erase_user_sessions(
    backend: StateBackend,
    tenant_id: str,
    user_id: str,
    *,
    also: Iterable[str] = (),
) -> StateErasure:
    """Erase from ``backend`` every session of ``tenant_id`` whose state names ``user_id`` as
    its owner (see `user_session_keys`). Idempotent: run again, it finds nothing more."""
    owned, _ = user_session_keys(backend, tenant_id, user_id, also=also)
    counts = backend.erase_sessions(owned) if owned else {}
    return StateErasure(sessions=tuple(owned), counts=counts)


_BEFORE_ANY_EXPIRY = 0.0
"""The time ownership is read at: 1970, before any session's expiry, so an expired session
not yet vacuumed is read (and erased) as a live one is."""


def _owner(backend: StateBackend, session_id: str, tenant_id: str, user_id: str) -> str:
    """``"user"`` (the state names ``user_id``), ``"absent"`` (no session) or ``"other"``."""
    try:
        chain = backend.read_chain(session_id, None, _BEFORE_ANY_EXPIRY)
    except ExpiredError:  # a backend that forgets expired sessions (Redis): gone already
        return "absent"
    if chain is None or not chain.rows:
        return "absent"
    try:
        state = replay(row.payload for row in chain.rows)
    except ValueError:
        return "other"
    runtime: Any = state.get("runtime")
    if not isinstance(runtime, dict):
        return "other"
    mine = runtime.get("user_id") == user_id and runtime.get("tenant_id") in (None, tenant_id)
    return "user" if mine else "other"
