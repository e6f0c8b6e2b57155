"""The ids and texts a client sends the service, checked once, the same way on every route.

A **session id on the wire** (a path segment, the ``X-Keel-Session`` header, a body field) is
1 to 256 characters of ``A-Z a-z 0-9 - . _ ~ : @`` and percent-encoded UTF-8 bytes (``%2F``
for ``/``, ``%C3%A9`` for ``é``); it names the session its percent-decoding spells. So every
session [`Agent.run`][] accepts (any printable id) is reachable,
and one id has one spelling whatever carries it: ``X-Keel-Session: team/alpha`` or a raw
``café`` header (which HTTP would hand over as Latin-1) is 422, not another session.

A **user id** is the agent's: non-blank printable text, at most 256 characters. Text fields
(messages, notes, verdicts) hold no NUL: PostgreSQL cannot store one, so both backends refuse
it, before anything is written. Every refusal is 422 naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import quote, unquote

from fastapi.routing import APIRoute
from pydantic import AfterValidator, Field
from starlette.routing import Match
from starlette.types import Scope

from keel.errors import UsageError
from keel.runtime._session import require_id
from keel.service._errors import HTTPError

__all__ = [
    "PLAIN_ID",
    "SESSION_ID_GRAMMAR",
    "RawPathRoute",
    "Text",
    "UserId",
    "check_user_id",
    "session_id_from_wire",
    "session_url",
    "text_without_nul",
]

SESSION_ID_GRAMMAR = r"(?:[A-Za-z0-9\-._~:@]|%[0-9A-Fa-f]{2}){1,256}"
"""What a session id looks like on the wire (a path segment, a header, a body field)."""

_SESSION_ID = re.compile(SESSION_ID_GRAMMAR)

PLAIN_ID = r"^[A-Za-z0-9\-._~:@]+$"
"""What the ids keel hands out look like (runs, memory records, journal keys)."""


def session_id_from_wire(spelled: str, where: str = "session_id") -> str:
    """The session a client's spelling names (percent-decoded); 422 outside the grammar."""
    if not _SESSION_ID.fullmatch(spelled):
        raise HTTPError(
            422,
            "ValidationError",
            f"{where}: a session id is 1-256 of A-Z a-z 0-9 - . _ ~ : @ and %XX "
            "(percent-encode anything else as UTF-8)",
        )
    try:
        decoded = unquote(spelled, errors="strict")
        require_id(where, decoded)
    except (UnicodeDecodeError, UsageError):
        raise HTTPError(
            422, "ValidationError", f"{where}: the percent-encoding spells no printable id"
        ) from None
    return decoded


def session_url(session_id: str) -> str:
    """The spelling of ``session_id`` for a URL path (the inverse of the decoding)."""
    return quote(session_id, safe="-._~:@")


def check_user_id(value: str) -> str:
    """A user id as the agent takes it (non-blank printable text); ValueError otherwise."""
    try:
        require_id("user", value)
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    return value


def text_without_nul(value: str) -> str:
    """Text PostgreSQL can store as SQLite does; ValueError for a NUL character."""
    if "\x00" in value:
        raise ValueError("text cannot hold a NUL character (U+0000)")
    return value


UserId = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(check_user_id)]
"""A user id in a body or a query."""

Text = Annotated[str, AfterValidator(text_without_nul)]
"""Text a client sends to be stored."""


class RawPathRoute(APIRoute):
    """A route matched on the path as it was sent (``raw_path``), not on its decoding: a
    session id spelled ``team%2Falpha`` stays one path segment (decoded, ``/`` would split
    it), and its parameter is the spelling, for `session_id_from_wire` to decode."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        raw_path = scope.get("raw_path")
        if scope["type"] == "http" and isinstance(raw_path, bytes):
            path = raw_path.decode("latin-1")
            root_path = scope.get("root_path", "")
            if root_path and path.startswith(root_path):
                path = path[len(root_path) :]
            scope = {**scope, "path": path, "root_path": ""}
        return super().matches(scope)
