"""``keel ui``: the web trace viewer on the embedded database (or --database)."""

from __future__ import annotations

from typing import Annotated

import typer

from keel.cli._app import app, out_console
from keel.cli._database import DatabaseOption
from keel.cli._serve import _keys


@app.command("ui")
def ui_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    database: DatabaseOption = None,
    tenant: Annotated[str, typer.Option(help="The tenant to look at.")] = "default",
    memory: Annotated[bool, typer.Option(help="Show long-term memory.")] = True,
) -> None:
    """Open the web trace viewer on the embedded database (or --database): runs, sessions,
    memory and health. It prints a key for TENANT that signs you in, revoked when it stops."""
    import uvicorn

    from keel.cli._database import database_settings
    from keel.service import build_service

    # The viewer opens a database; it never makes one.
    settings = database_settings(database)
    service, _, _ = build_service(database, memory=memory, settings=settings)
    # The key lives on its own connection: the service closes its stores when it stops.
    backends, keys = _keys(database)
    try:
        key = keys.create(tenant)
        out_console.print(f"keel ui: http://{host}:{port}/ui  (tenant {tenant})", markup=False)
        out_console.print(
            f"sign in with this key (revoked when keel ui stops): {key}", markup=False
        )
        try:
            uvicorn.run(service, host=host, port=port, log_level="warning")
        finally:
            keys.revoke(key.removeprefix("keel_").split("_", 1)[0])
    finally:
        backends.close()
