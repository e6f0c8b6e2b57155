"""Query parameters a route does not take are refused, not ignored: ``GET /v1/runs?user=bob``
with an operator key would otherwise answer every user's runs as if they were bob's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import Request
from starlette.routing import BaseRoute

from keel.service._errors import HTTPError

__all__ = ["known_query"]

_TAKEN: dict[object, frozenset[str]] = {}
"""Each route's query parameter names, by its endpoint: keel's routes' endpoints are module-level
functions, one set of parameters each, in whichever app includes them."""


def _taken(route: BaseRoute) -> frozenset[str] | None:
    dependant = getattr(route, "dependant", None)
    endpoint = getattr(route, "endpoint", None)
    if dependant is None or endpoint is None:
        return None
    names = _TAKEN.get(endpoint)
    if names is None:
        names = frozenset(_query_names(dependant))
        _TAKEN[endpoint] = names
    return names


def _query_names(dependant: Any) -> Iterator[str]:
    # FastAPI's own flattening is private and moved between versions; the tree is public.
    yield from (param.alias for param in dependant.query_params)
    for sub in dependant.dependencies:
        yield from _query_names(sub)


async def known_query(request: Request) -> None:
    """400 naming the first query parameter the matched route does not take."""
    route = request.scope.get("route")
    taken = None if route is None else _taken(route)
    if taken is None:
        return
    unknown = sorted(set(request.query_params) - taken)
    if unknown:
        takes = ", ".join(sorted(taken)) or "none"
        raise HTTPError(
            400,
            "UnknownParameter",
            f"{unknown[0]}: not a query parameter of this route (it takes: {takes})",
            param=unknown[0],
        )
