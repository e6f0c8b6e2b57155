"""``keel privacy ...``: the PII vault's master key, a user's erasure, key rotation and status.

The vault opens with the master key the settings give (``KEEL_PII_KEY`` or
``KEEL_PII_KEY_FILE``), checked against the database: a wrong key is an error line, never a
command run on a vault it cannot open. No command prints a stored value or a data key; only
``new-key`` prints a key, the new one it made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import JsonOption, app, emit_or_show, out_console
from keel.cli._database import DatabaseOption

if TYPE_CHECKING:
    from keel.privacy import KeyProvider, MasterKey, Vault
    from keel.stores import Backends
    from keel.stores._sql_vault import VaultCounts

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
def _backends(database: str | None, *, also: Sequence[KeyProvider] = ()) -> Iterator[Backends]:
    """The stores of ``--database`` (else the configured one) with the vault if a key is set;
    ``also``: keys beside the configured ones (a rotation's other key)."""
    from keel.cli._database import database_settings
    from keel.errors import VaultKeyError
    from keel.privacy import KeyRing
    from keel.stores import Backends
    from keel.stores._open import pii_key_from_settings

    settings = database_settings(database)
    ring = None
    if also:
        configured = pii_key_from_settings(settings)
        if configured is None:
            raise VaultKeyError(_NO_KEY)
        ring = KeyRing(configured.current, [*configured.previous, *also])
    backends = Backends.open(settings, redis_url="", memory=False, pii_key=ring)
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
    from keel.privacy._keys import write_key_file

    try:
        write_key_file(path, text)
    except FileExistsError:
        raise UsageError(f"{path} exists: a key file is never overwritten") from None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None


_FINAL_ONLY_AFTER_ROTATION = (
    "not yet in copies of the database (PostgreSQL's write-ahead log, replicas, backups): "
    "they open with the current master key until it is rotated away and destroyed "
    "(`keel privacy forget --finalize --new-key-file NEW` does both)"
)

NewKeyFile = Annotated[
    Path | None, typer.Option("--new-key-file", help="A file holding the new master key.")
]
NewKeyEnv = Annotated[
    str | None,
    typer.Option("--new-key-env", help="The environment variable holding the new key."),
]


@privacy_app.command("forget")
def forget_command(
    tenant: Annotated[str, typer.Option("--tenant", help="The user's tenant.")],
    user: Annotated[str, typer.Option("--user", help="The user whose values to erase.")],
    finalize: Annotated[
        bool,
        typer.Option(
            "--finalize",
            help="Then rotate the master key to the new key given (--new-key-file/-env), so "
            "that copies of the database (WAL, replicas, backups) hold nothing the new key "
            "opens; destroy the old key afterwards.",
        ),
    ] = False,
    new_key_file: NewKeyFile = None,
    new_key_env: NewKeyEnv = None,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Erase a user's values: their data key is destroyed (placeholders stay). Final in
    copies of the database once the master key is rotated away and destroyed (--finalize).
    To erase the user from every store instead (sessions, memory, traces...): keel users
    erase TENANT USER."""
    from keel.errors import UsageError

    if not tenant.strip() or not user.strip():
        raise UsageError("--tenant and --user must not be empty")
    new = None
    if finalize:
        new = _given_key("--new-key", new_key_file, new_key_env)
    elif new_key_file is not None or new_key_env is not None:
        raise UsageError("a new key is given with --finalize only")
    with _backends(database) as backends:
        vault = _vault(backends)
        old_id = vault.keys.key_id
        erased = vault.forget(tenant, user)
        rewrapped = None if new is None else vault.rotate(new)
    payload: dict[str, Any] = {"tenant": tenant, "user": user, "erased": erased}
    if new is None:
        payload["final"] = _FINAL_ONLY_AFTER_ROTATION
    else:
        payload |= {"rewrapped": rewrapped, "old_key_id": old_id, "key_id": new.key_id}
        payload["final"] = (
            f"once master key {old_id} is destroyed (every copy of KEEL_PII_KEY / its key "
            f"file): run keel with key {new.key_id} from now on"
        )
    emit_or_show(payload, as_json, _show_forget)


def _show_forget(payload: dict[str, Any]) -> None:
    out_console.print(f"erased {payload['erased']} values of {payload['tenant']}/{payload['user']}")
    if "rewrapped" in payload:
        out_console.print(
            f"re-wrapped {payload['rewrapped']} data keys under key {payload['key_id']} "
            f"(was {payload['old_key_id']})"
        )
    out_console.print(f"final: {payload['final']}", soft_wrap=True)


@privacy_app.command("rotate-key")
def rotate_key_command(
    new_key_file: NewKeyFile = None,
    new_key_env: NewKeyEnv = None,
    old_key_file: Annotated[
        Path | None,
        typer.Option(
            "--old-key-file",
            help="Finish a rotation to the configured key (KEEL_PII_KEY) from this old one.",
        ),
    ] = None,
    old_key_env: Annotated[
        str | None,
        typer.Option("--old-key-env", help="As --old-key-file, the old key in this variable."),
    ] = None,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Re-wrap every data key under a new master key (then run keel with the new key).

    Killed, rerun it: with the old key configured and --new-key-..., or with the new key
    configured and --old-key-...; either finishes the rotation."""
    from keel.errors import UsageError

    finishing = old_key_file is not None or old_key_env is not None
    if finishing and (new_key_file is not None or new_key_env is not None):
        raise UsageError("give either the new key (--new-key-...) or the old one (--old-key-...)")
    if finishing:
        other = _given_key("--old-key", old_key_file, old_key_env)
    else:
        other = _given_key("--new-key", new_key_file, new_key_env)
    with _backends(database, also=[other]) as backends:
        vault = _vault(backends)
        current = vault.keys
        new, old = (current, other) if finishing else (other, current)
        rewrapped = vault.rotate(new)
    payload = {"rewrapped": rewrapped, "old_key_id": old.key_id, "key_id": new.key_id}
    emit_or_show(
        payload,
        as_json,
        lambda _: out_console.print(
            f"re-wrapped {rewrapped} data keys under key {new.key_id} (was {old.key_id}); "
            "from now on keel must run with the new key"
        ),
    )


def _given_key(flag: str, path: Path | None, variable: str | None) -> MasterKey:
    from keel.errors import UsageError, VaultKeyError
    from keel.privacy import MasterKey

    if (path is None) == (variable is None):
        raise UsageError(
            f"give the {flag[2:].replace('-', ' ')} with one of {flag}-file or {flag}-env"
        )
    if path is not None:
        return MasterKey.from_file(path)
    assert variable is not None
    text = os.environ.get(variable, "")
    if not text.strip():
        raise VaultKeyError(f"the environment variable {variable} holds no key")
    return MasterKey.from_text(text, source=variable)


@privacy_app.command("status")
def status_command(database: DatabaseOption = None, as_json: JsonOption = False) -> None:
    """Whether the vault is on, its key's id, and how many users and values it holds (also
    without a key: a vault whose key is missing is reported as such)."""
    from keel.cli._database import database_settings
    from keel.stores import Backends
    from keel.stores._open import pii_key_from_settings

    settings = database_settings(database)
    keyless = pii_key_from_settings(settings) is None and (
        not settings.pii_vault or settings.sqlite_path is None
    )
    if keyless:
        # Nothing opens the vault: what the database holds is counted all the same.
        with Backends.open(settings, redis_url="", memory=False, vault=False) as backends:
            counts = _counts(backends)
        held = counts.users + counts.values + counts.erased > 0
        reason = "KEEL_PII_VAULT=off" if not settings.pii_vault else "no KEEL_PII_KEY"
        payload: dict[str, Any] = {
            "vault": "key missing" if held and settings.pii_vault else "off",
            "reason": reason,
            "users": counts.users,
            "values": counts.values,
            "erased": counts.erased,
        }
    else:
        with _backends(database) as backends:
            vault = _vault(backends)
            counts = _counts(backends)
            payload = {
                "vault": "on",
                "key_id": vault.keys.key_id,
                "users": counts.users,
                "values": counts.values,
                "erased": counts.erased,
            }
    emit_or_show(payload, as_json, _show_status)


def _counts(backends: Backends) -> VaultCounts:
    return backends.vault_store.counts()


def _show_status(payload: dict[str, Any]) -> None:
    held = (
        f"{payload['users']} users, {payload['values']} values sealed, {payload['erased']} erased"
    )
    if payload["vault"] == "key missing":
        out_console.print(
            f"vault: KEY MISSING ({payload['reason']}): this database holds {held}, and no "
            "value of theirs can be resolved without the key"
        )
        return
    if payload["vault"] == "off":
        out_console.print(
            f"vault: off ({payload['reason']}); masked values are not kept ({_NO_KEY}); "
            f"the database holds {held}"
        )
        return
    out_console.print(f"vault: on, key {payload['key_id']}")
    out_console.print(f"  {held}")


users_app = typer.Typer(
    help="A tenant's users: erase one from every store.",
    no_args_is_help=True,
)
app.add_typer(users_app, name="users")


@users_app.command("erase")
def erase_user_command(
    tenant: Annotated[str, typer.Argument(help="The user's tenant.")],
    user: Annotated[str, typer.Argument(help="The user to erase.")],
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Erase a user of a tenant from every store: their sessions and checkpoints (on Redis
    too, when KEEL_REDIS_URL is set), tool journal, approvals, traces, memory, vault rows and
    API keys; another tenant's user of the same id is left alone. Prints what was removed,
    by store and table, and writes an audit row without the user (keel_erasures). Killed
    half-way, run it again: it finishes the job. (``keel privacy forget`` erases only the
    vault's values, leaving placeholders.)"""
    from keel.cli._database import database_settings
    from keel.stores import Backends, erase_user
    from keel.stores._sql_plan import table_names

    settings = database_settings(database)
    # No vault key and no embedder are needed to delete rows: the backends build both stores
    # on the database for the erasure (Backends.vault_store, Backends.memory_store).
    with Backends.open(settings, memory=False, vault=False) as backends:
        extra = {}
        if "keel_api_keys" in table_names(backends.sql):
            from keel.service._keys import APIKeys

            extra["service"] = APIKeys(backends.sql).erase_user
        report = erase_user(backends, tenant, user, requested_by="cli", extra=extra)
    emit_or_show(report.to_dict(), as_json, _show_erasure)


def _show_erasure(payload: dict[str, Any]) -> None:
    out_console.print(
        f"erased {payload['total']} rows of one user of {payload['tenant_id']} "
        f"(audit row {payload['erasure_id']} in keel_erasures)"
    )
    for store, tables in payload["removed"].items():
        counts = ", ".join(f"{table} {count}" for table, count in sorted(tables.items()))
        out_console.print(f"  {store}: {counts or 'nothing'}")
