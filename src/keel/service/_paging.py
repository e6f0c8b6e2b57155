"""Bounded listings: a page holds at most ``limit`` items (``MAX_PAGE`` at most); when more
follow, the response names the next page, in ``X-Next-Cursor`` (pass it back as ``cursor``)
and as a ``Link: <...>; rel="next"`` header. Long texts in a listing are clipped to
``CLIPPED_CHARS`` (the item then says ``"clipped": true``); the item's own route has them whole.
"""

from __future__ import annotations

from typing import Any

from fastapi import Query, Request, Response

from keel.service._errors import HTTPError

__all__ = [
    "CLIPPED_CHARS",
    "MAX_PAGE",
    "clip",
    "cursor_query",
    "limit_query",
    "next_page",
    "number_cursor",
]

MAX_PAGE = 200
"""The most items one page of a listing holds."""

CLIPPED_CHARS = 1_000
"""How much of a long text a listing shows."""


def limit_query(default: int = 50) -> Any:
    """The ``limit`` parameter of a listing."""
    return Query(default=default, ge=1, le=MAX_PAGE, description="Items per page.")


def cursor_query() -> Any:
    """The ``cursor`` parameter of a listing: ``X-Next-Cursor`` of the page before."""
    return Query(
        default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$",
        description="Where the page starts: the previous page's X-Next-Cursor.",
    )  # fmt: skip


def bad_cursor() -> HTTPError:
    """422 for a cursor this listing never handed out."""
    return HTTPError(422, "ValidationError", "cursor: not a cursor of this listing")


def number_cursor(cursor: str | None) -> int | None:
    """A listing's cursor that is a number (a version, an offset); 422 for any other."""
    if cursor is None:
        return None
    if not cursor.isdigit():
        raise bad_cursor()
    return int(cursor)


def next_page(request: Request, response: Response, cursor: str | None) -> None:
    """Name the next page of the listing, when there is one."""
    if cursor is None:
        return
    url = request.url.include_query_params(cursor=cursor)
    response.headers["X-Next-Cursor"] = cursor
    response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'


def clip(item: dict[str, Any], *fields: str) -> dict[str, Any]:
    """``item`` with each long text of ``fields`` cut to ``CLIPPED_CHARS``."""
    clipped = False
    for name in fields:
        text = item.get(name)
        if isinstance(text, str) and len(text) > CLIPPED_CHARS:
            item[name] = text[:CLIPPED_CHARS] + "…"
            clipped = True
    item["clipped"] = clipped
    return item
