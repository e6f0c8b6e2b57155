"""``keel ui``: the web trace viewer on the embedded database (or --database)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from keel.cli._app import app, out_console
from keel.cli._database import DatabaseOption
from keel.cli._serve import _keys

if TYPE_CHECKING:
    import uvicorn


@app.command("ui")
def ui_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    database: DatabaseOption = None,
    tenant: Annotated[str, typer.Option(help="The tenant to look at.")] = "default",
    memory: Annotated[bool, typer.Option(help="Show long-term memory.")] = True,
) -> None:
    """Open the web trace viewer on the embedded database (or --database): runs, sessions,
    memory and health. It prints a key for TENANT that signs you in, revoked when it stops
    (Ctrl-C, SIGTERM, SIGHUP)."""
    import uvicorn

    from keel.cli._database import database_settings
    from keel.service import build_service
    from keel.service._keys import key_id_of

    # The viewer opens a database; it never makes one.
    settings = database_settings(database)
    service, _, _ = build_service(database, memory=memory, settings=settings)
    server = uvicorn.Server(uvicorn.Config(service, host=host, port=port, log_level="warning"))
    # The key lives on its own connection: the service closes its stores when it stops.
    backends, keys = _keys(database)
    try:
        with _stopped_by_signals(server):
            key = keys.create(tenant)
            try:
                out_console.print(
                    f"keel ui: http://{host}:{port}/ui  (tenant {tenant})", markup=False
                )
                out_console.print(
                    f"sign in with this key (revoked when keel ui stops): {key}", markup=False
                )
                server.run()
            finally:
                keys.revoke(key_id_of(key) or "")
    finally:
        backends.close()


@contextlib.contextmanager
def _stopped_by_signals(server: uvicorn.Server) -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP stop ``server`` gracefully, so that what
    follows its ``run`` (revoking the sign-in key) runs. Uvicorn handles SIGINT and SIGTERM
    itself while it serves, then raises the signal again once stopped: with the default
    handlers a SIGTERM killed the process there, before the key was revoked (and SIGHUP, which
    uvicorn does not handle, killed it at once)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        server.should_exit = True

    names = ("SIGINT", "SIGTERM", "SIGHUP")  # no SIGHUP on Windows
    stops = [getattr(signal, name) for name in names if hasattr(signal, name)]
    previous = {signum: signal.signal(signum, stop) for signum in stops}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
