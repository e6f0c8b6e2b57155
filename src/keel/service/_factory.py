"""The app factory uvicorn's worker processes import: each builds its own service from the
[`ServeOptions`][] ``keel serve --workers N`` set (as JSON, in
``KEEL_SERVE_OPTIONS``), on the same database (and Redis).

Each worker drains on SIGTERM as a single process does (``DrainingMultiprocess``). Workers
share nothing in memory; correctness comes from the stores: compare-and-set on every
checkpoint, and the session lease (in the state store: SQLite, PostgreSQL or Redis) that lets
one turn of a session run at a time, whichever worker took it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from keel.service._drain import worker_drain
from keel.service._process import freeze_startup_heap
from keel.service._serve import ServeOptions

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["SERVE_ENV", "create"]

SERVE_ENV = "KEEL_SERVE_OPTIONS"
"""The environment variable holding the service's options ([`ServeOptions`][] as JSON) for
the workers."""


def create() -> FastAPI:
    """The service, from ``KEEL_SERVE_OPTIONS`` (uvicorn calls this once per worker).

    Raises:
        ConfigError: the variable does not hold valid [`ServeOptions`][].
    """
    options = ServeOptions.from_json(os.environ.get(SERVE_ENV, "{}"))
    # The drain this worker's server (a DrainingServer) starts on SIGTERM.
    app, _, _ = options.build(drain=worker_drain())
    # This process is one of uvicorn's workers: it serves and does nothing else.
    freeze_startup_heap()
    return app
