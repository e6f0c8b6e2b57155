"""What the adapters share to keep a user's values out of storage and give them back on reads.

An adapter masks what it stores and reveals what the framework reads through a
[`PrivacyView`][]: one user's view for one call, the one every part of keel
uses. With a [`Vault`][], masking numbers each value
with the user's stable placeholder (the value goes into the vault, sealed) and a read reveals
the user's own placeholders (another user's, or an erased one, stay as written). Without one,
masking is keel's masker as it always was and nothing is revealed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Self, TypeVar

from pydantic import BaseModel

from keel._urls import parse_database_url
from keel.errors import AccessDeniedError, ConfigError, UsageError, VaultKeyError
from keel.privacy import (
    DEFAULT_MASKER,
    PIIMasker,
    PrivacyView,
    Vault,
    privacy_view,
)
from keel.settings import load_settings
from keel.state import StateBackend, StateStore
from keel.stores import (
    SQLStateBackend,
    open_state_backend,
    open_vault,
    pii_key_from_settings,
)

__all__ = ["NEEDS_VAULT", "PrivateHistory", "map_texts", "open_with_vault"]

NEEDS_VAULT = (
    "{} holds values sealed in a PII vault: write to it with that vault (vault=, or "
    "KEEL_PII_KEY / KEEL_PII_KEY_FILE); placeholders numbered without it would read back as "
    "other values"
)

S = TypeVar("S", bound=BaseModel)


class PrivateHistory(Generic[S]):
    """What the Agents SDK session and the pydantic-ai message store share: one
    conversation's history on a state store (opened from ``database`` and owned, or passed in
    as ``state``), the user it belongs to, and the vault its values go to.

    Raises:
        UsageError: not exactly one of ``database`` and ``state``, or an empty tenant.
        VaultKeyError: as `open_with_vault`.
    """

    def __init__(
        self,
        schema: type[S],
        conversation_id: str,
        *,
        database: str | None,
        state: StateStore[S] | None,
        masker: PIIMasker | None,
        tenant: str,
        user_id: str | None,
        vault: Vault | None,
    ) -> None:
        if (database is None) == (state is None):
            raise UsageError("give exactly one of database and state")
        if not tenant:
            raise UsageError("a tenant must not be empty")
        self.tenant = tenant
        self.user_id = user_id or conversation_id
        self.masker = DEFAULT_MASKER if masker is None else masker
        self.vault = vault
        self._owns_state = state is None
        if state is None:
            backend, self.vault = open_with_vault(str(database), vault)
            state = StateStore(backend, schema)
        self.state: StateStore[S] = state

    @property
    def new_owner(self) -> str:
        """Who owns a history this creates: its user, with a vault ("": nobody)."""
        return self.user_id if self.vault is not None else ""

    def _reading_view(self, owner: str) -> PrivacyView:
        """The view a read reveals with: the owner's values to the owner alone (anyone else,
        or a history stored without a vault: placeholders)."""
        vault = self.vault if owner == self.user_id else None
        return privacy_view(self.masker, self.tenant, self.user_id, vault)

    def _writing_view(self, owner: str | None, *, per_call: bool = False) -> PrivacyView:
        """The view a write masks with: the user's vault numbering for a history of theirs
        (or a new one, ``owner`` None); masking alone for one stored without a vault.

        Raises:
            AccessDeniedError: the history holds another user's values.
            VaultKeyError: it holds a user's values and this has no vault.
        """
        if owner and self.vault is None:
            raise VaultKeyError(NEEDS_VAULT.format("the history"))
        if owner is not None and owner not in ("", self.user_id):
            raise AccessDeniedError(
                f"the history holds another user's values; {self.user_id!r} cannot write to it"
            )
        vault = self.vault if owner in (None, self.user_id) else None
        return privacy_view(self.masker, self.tenant, self.user_id, vault, per_call=per_call)

    def close(self) -> None:
        """Release the database this opened (a ``state`` passed in stays open)."""
        if self._owns_state:
            self.state.close()

    async def aclose(self) -> None:
        """Async twin of `close`."""
        if self._owns_state:
            await self.state.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def open_with_vault(url: str, vault: Vault | None) -> tuple[StateBackend, Vault | None]:
    """The state backend ``url`` names, and the vault the adapter uses: ``vault`` when given;
    else, for a SQL URL, the one an agent on that very database gets from ``Backends.open``
    ([`keel.stores.open_vault`][]): under ``KEEL_PII_KEY`` / ``KEEL_PII_KEY_FILE``; with
    neither, on SQLite under keel's own key file in the config directory, on PostgreSQL none
    (refused where the database holds a vault); none with ``KEEL_PII_VAULT=off``, or for a
    Redis URL. The vault's store closes with the backend.

    Raises:
        VaultKeyError: the environment's key is malformed (nothing is opened), or the key is
            not the database's vault's, or a PostgreSQL database holds a vault and no key is
            given (the backend is closed again).
        ConfigError: ``KEEL_PII_VAULT`` is not a yes or a no.
    """
    settings = load_settings() if vault is None and _names_sql(url) else None
    wanted = settings is not None and settings.pii_vault
    # The keys Backends.open takes: the current one, and the previous one mid-rotation.
    keys = pii_key_from_settings(settings) if settings is not None and wanted else None
    backend = open_state_backend(url)
    if not wanted:
        return backend, vault
    try:
        assert isinstance(backend, SQLStateBackend)
        return backend, open_vault(backend.database, keys)
    except BaseException:
        backend.close()
        raise


def _names_sql(url: str) -> bool:
    try:
        return parse_database_url(url).kind != "redis"
    except ConfigError:
        return False  # the opener says what is wrong with it


def map_texts(
    value: Any,
    change: Callable[[str], str],
    *,
    texts: frozenset[str],
    kept: frozenset[str] = frozenset(),
    key: str | None = None,
    inside: bool = False,
) -> Any:
    """A JSON-like ``value`` (dicts, lists, strings) with ``change`` applied to the strings
    under a key in ``texts`` (at any depth below it), except those under a key in ``kept``;
    the very same object where nothing changed."""
    if isinstance(value, str):
        return change(value) if inside and key not in kept else value
    if isinstance(value, dict):
        entries = {
            name: map_texts(
                item,
                change,
                texts=texts,
                kept=kept,
                key=name,
                inside=inside or name in texts,
            )
            for name, item in value.items()
        }
        return entries if any(entries[k] is not v for k, v in value.items()) else value
    if isinstance(value, list):
        items = [
            map_texts(item, change, texts=texts, kept=kept, key=key, inside=inside)
            for item in value
        ]
        return (
            items if any(new is not old for new, old in zip(items, value, strict=True)) else value
        )
    return value
