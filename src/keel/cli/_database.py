"""``--database``: the one option every command that reads or writes keel's database takes, and
the rule for opening it.

Opening a database never creates one: a SQLite file that is not there is an error, so a
mistyped path is reported instead of becoming a new, empty database. keel creates the file
only where that is the point: the default database in the data directory, the database the
settings configure (``KEEL_DATABASE``) for a command that writes, and any path given with
``--create``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from pathlib import Path

    from keel.settings import Settings

__all__ = ["CreateOption", "DatabaseOption", "database_settings"]

DATABASE_HELP = (
    "Database URL: sqlite:///PATH or postgresql://... (default: KEEL_DATABASE, else keel.db in "
    "the data directory). A SQLite file must exist unless it is the default one."
)

_HOLDS_PASSWORD = re.compile(r"://[^:/@]*:[^@/]+@|[?&]password=[^&]")
"""A URL with a non-empty password in its user info or in libpq's query parameters."""

DatabaseOption = Annotated[str | None, typer.Option("--database", help=DATABASE_HELP)]
CreateOption = Annotated[
    bool,
    typer.Option("--create", help="Create the --database SQLite file if it does not exist."),
]


def database_settings(
    database: str | None, *, writes: bool = False, create: bool = False
) -> Settings:
    """The settings a command runs with: ``--database`` (when given) in place of the configured
    URL, checked to name a database that exists.

    Args:
        database: the ``--database`` value, or None for the configured database.
        writes: the command writes (chat, serve): the configured database is created when
            missing, as the data directory's default always is.
        create: ``--create``: the ``--database`` file too.

    Raises:
        ConfigError: a URL keel cannot open.
        UsageError: the URL names a SQLite file that does not exist and may not be created.
    """
    from keel.settings import load_settings

    if database is not None and _HOLDS_PASSWORD.search(database):
        from keel.cli._app import err_console

        err_console.print(
            "warning: --database holds a password, which ps shows to every user of this "
            "machine: set the URL in KEEL_DATABASE instead",
            markup=False,
        )
    settings = load_settings(**({"database": database} if database is not None else {}))
    path = settings.sqlite_path
    if path is None or path.exists() or _is_default(path, settings):
        return settings
    if create or (writes and database is None):
        return settings
    raise _missing(path, settings, from_flag=database is not None, writes=writes)


def _is_default(path: Path, settings: Settings) -> bool:
    """``path`` is the data directory's keel.db, which keel creates on first use."""
    return path.expanduser().resolve() == (settings.data_dir / "keel.db").expanduser().resolve()


def _missing(path: Path, settings: Settings, *, from_flag: bool, writes: bool) -> Exception:
    from keel.errors import UsageError

    where = "" if path.parent.is_dir() else f" (the directory {path.parent} does not exist)"
    source = "--database" if from_flag else "KEEL_DATABASE"
    if writes:
        hint = "check the path, or add --create to start a new database there"
    else:
        hint = (
            "check the path; a new database is made by the commands that write to one "
            "(keel chat, keel serve, keel demo)"
        )
    return UsageError(f"no database at {path}{where}, as {source} names: {hint}")
