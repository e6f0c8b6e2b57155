"""``keel privacy ...``: the PII vault's master key, a user's erasure, key rotation and status.

The vault opens with the master key the settings give (``KEEL_PII_KEY`` or
``KEEL_PII_KEY_FILE``), checked against the database: a wrong key is an error line, never a
command run on a vault it cannot open. No command prints a stored value or a data key; only
``new-key`` prints a key, the new one it made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import JsonOption, app, emit_or_show, out_console
from keel.cli._database import DatabaseOption

if TYPE_CHECKING:
    from keel.privacy import MasterKey, Vault
    from keel.stores import Backends

privacy_app = typer.Typer(
    help="The PII vault: a new master key, forget a user, rotate the key, status.",
    no_args_is_help=True,
)
app.add_typer(privacy_app, name="privacy")

_NO_KEY = (
    "no PII master key: set KEEL_PII_KEY (make one with `keel privacy new-key`) or "
    "KEEL_PII_KEY_FILE"
)


@contextmanager
def _backends(database: str | None) -> Iterator[Backends]:
    """The stores of ``--database`` (else the configured one) with the vault if a key is set."""
    from keel.cli._database import database_settings
    from keel.stores import Backends

    backends = Backends.open(database_settings(database), redis_url="", memory=False)
    try:
        yield backends
    finally:
        backends.close()


def _vault(backends: Backends) -> Vault:
    from keel.errors import VaultKeyError

    if backends.vault is None:
        raise VaultKeyError(_NO_KEY)
    return backends.vault


@privacy_app.command("new-key")
def new_key_command(
    file: Annotated[
        Path | None,
        typer.Option("--file", help="Write the key to this new file (mode 0600) instead."),
    ] = None,
) -> None:
    """Print a new random master key, as KEEL_PII_KEY takes it (keel never stores it)."""
    from keel.privacy import MasterKey

    text = MasterKey.new_key_text()
    if file is None:
        out_console.print(text)
        return
    _write_key_file(file, text)
    out_console.print(f"wrote a new PII key to {file} (set KEEL_PII_KEY_FILE={file})")


def _write_key_file(path: Path, text: str) -> None:
    from keel.errors import UsageError

    try:
        # O_EXCL: never overwrite a key, which would lose every value it opens.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} exists: a key file is never overwritten") from None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(descriptor, "w", encoding="ascii") as out:
        out.write(text + "\n")


@privacy_app.command("forget")
def forget_command(
    tenant: Annotated[str, typer.Option("--tenant", help="The user's tenant.")],
    user: Annotated[str, typer.Option("--user", help="The user whose values to erase.")],
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Erase a user's values for good: their data key is destroyed (placeholders stay)."""
    from keel.errors import UsageError

    if not tenant.strip() or not user.strip():
        raise UsageError("--tenant and --user must not be empty")
    with _backends(database) as backends:
        erased = _vault(backends).forget(tenant, user)
    payload = {"tenant": tenant, "user": user, "erased": erased}
    emit_or_show(
        payload,
        as_json,
        lambda _: out_console.print(f"erased {erased} values of {tenant}/{user}"),
    )


@privacy_app.command("rotate-key")
def rotate_key_command(
    new_key_file: Annotated[
        Path | None, typer.Option("--new-key-file", help="A file holding the new master key.")
    ] = None,
    new_key_env: Annotated[
        str | None,
        typer.Option("--new-key-env", help="The environment variable holding the new key."),
    ] = None,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Re-wrap every data key under a new master key (then run keel with the new key)."""
    new = _new_key(new_key_file, new_key_env)
    with _backends(database) as backends:
        vault = _vault(backends)
        old_id = vault.keys.key_id
        rewrapped = vault.rotate(new)
    payload = {"rewrapped": rewrapped, "old_key_id": old_id, "key_id": new.key_id}
    emit_or_show(
        payload,
        as_json,
        lambda _: out_console.print(
            f"re-wrapped {rewrapped} data keys under key {new.key_id} (was {old_id}); "
            "from now on keel must run with the new key"
        ),
    )


def _new_key(path: Path | None, variable: str | None) -> MasterKey:
    from keel.errors import UsageError, VaultKeyError
    from keel.privacy import MasterKey

    if (path is None) == (variable is None):
        raise UsageError("give the new key with one of --new-key-file or --new-key-env")
    if path is not None:
        return MasterKey.from_file(path)
    assert variable is not None
    text = os.environ.get(variable, "")
    if not text.strip():
        raise VaultKeyError(f"the environment variable {variable} holds no key")
    return MasterKey.from_text(text, source=variable)


@privacy_app.command("status")
def status_command(database: DatabaseOption = None, as_json: JsonOption = False) -> None:
    """Whether the vault is on, its key's id, and how many users and values it holds."""
    from keel.stores._sql_vault import SQLVaultStore

    with _backends(database) as backends:
        payload: dict[str, Any] = {"vault": "off"}
        if backends.vault is not None:
            payload = {"vault": "on", "key_id": backends.vault.keys.key_id}
            store = backends.vault.store
            if isinstance(store, SQLVaultStore):
                counts = store.counts()
                payload |= {
                    "users": counts.users,
                    "values": counts.values,
                    "erased": counts.erased,
                }
    emit_or_show(payload, as_json, _show_status)


def _show_status(payload: dict[str, Any]) -> None:
    if payload["vault"] == "off":
        out_console.print(f"vault: off ({_NO_KEY}); masked values are not kept")
        return
    out_console.print(f"vault: on, key {payload['key_id']}")
    if "users" in payload:
        out_console.print(
            f"  {payload['users']} users, {payload['values']} values sealed, "
            f"{payload['erased']} erased"
        )
