"""The PII vault: stable placeholders for each tenant's and user's values, the values sealed.

Within one tenant and user, one value has one placeholder for ever (``<EMAIL_3>`` is the same
address in every turn, checkpoint, memory record and trace of that user, in every process). The
value is the one the masker reads ([`Finding.value`][keel.privacy.Finding]): written in JSON
escapes, or with an invisible character inside, it is the same value, kept as it reads.
The way from a value to its placeholder is an HMAC under the user's data key, never a plain
hash (a phone number or a zip code is easy to brute-force from an unkeyed one). The value
itself is sealed with AES-256-GCM under that data key, bound to its owner and its row; the data
key is stored only wrapped by the deployment's master key (`keel.privacy._keys`).

[`Vault`][] is the deployment's vault over a [`VaultStore`][] (SQLite or PostgreSQL,
opened with the other stores); [`Vault.user`][] gives the view of one tenant's user, which is
all a turn, a tool call or an adapter ever touches: another tenant's or user's placeholder is
unknown to it. ``forget`` destroys a user's data key and sealed values at once; their
placeholders stay in histories, resolving to nothing. Nothing here keeps a plaintext value
beyond one unit of work: a [`UserVault`][] holds its user's data key for its own life only
(one turn, one call), and the values that unit gave it to place (which it holds in the clear
in its own texts anyway); every other value is read sealed from the store each time it
resolves.

A placeholder's shape proves nothing: a tool's output, a web page or a document can spell
``<CREDIT_CARD_1>`` too, and a model can be talked into writing it. So text that enters from
such sources has its placeholder-shaped substrings neutralised ([`defang_placeholders`][]),
and once a unit of work has shown the model a prompt ([`UserVault.note_shown`][]) its view
resolves and reveals only the placeholders keel placed in that unit of work or showed the
model: a placeholder the model took from anywhere else is refused, not resolved.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from keel._bridge import run_blocking
from keel.errors import PlaceholderError, VaultKeyError
from keel.privacy._json_strings import JsonStrings, inside, json_escaped
from keel.privacy._keys import KEY_BYTES, KeyProvider, KeyRing

__all__ = [
    "PLACEHOLDER",
    "NoVault",
    "StoredKey",
    "UserVault",
    "Vault",
    "VaultStore",
    "defang_placeholders",
    "placeholders_in",
]

logger = logging.getLogger("keel.privacy")

PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)_([1-9][0-9]{0,8})>")
"""A placeholder as keel writes it: ``<EMAIL_3>``, ``<CREDIT_CARD_12>``."""

_PLACEHOLDER_TEXT = re.compile(r"<[A-Z][A-Z0-9_]*_[1-9][0-9]{0,8}>")
"""[`PLACEHOLDER`][] without its groups: ``findall`` gives the placeholders themselves (a
prompt is scanned before every model call)."""

_NO_PLACEHOLDERS: frozenset[str] = frozenset()

_DEFANGED = "\u2039{}\u203a"
"""How a placeholder-shaped text keel did not write is shown: ``<EMAIL_1>`` between single
guillemets (U+2039, U+203A) instead of ``<`` and ``>``, still readable, never a placeholder."""

_NONCE_BYTES = 12
_T = TypeVar("_T")
_CHECK_TENANT = ""
_CHECK_USER = ""
"""The key check lives under an owner no tenant can be (tenant ids are never empty)."""
_CHECK_PLAINTEXT = b"keel pii vault key check"

FOREIGN_REASON = (
    "keel did not place it in what the model was shown; it came from text keel did not write "
    "(a tool's output, a document), and stands for none of the user's values"
)


def placeholders_in(text: str) -> list[str]:
    """The placeholders written in ``text``, each once, in order."""
    return list(dict.fromkeys(match.group(0) for match in PLACEHOLDER.finditer(text)))


def placeholders_written(texts: Iterable[str]) -> frozenset[str]:
    """The placeholders written in ``texts``, as [`UserVault.note_shown`][] notes them."""
    found: frozenset[str] = _NO_PLACEHOLDERS
    for text in texts:
        if "<" in text:
            written = _PLACEHOLDER_TEXT.findall(text)
            if written:
                found = found.union(written)
    return found


def defang_placeholders(text: str, keep: Container[str] = frozenset()) -> str:
    """``text`` (from a source keel does not trust: a tool's output, a document) with every
    placeholder-shaped substring but those in ``keep`` written so that it is no placeholder
    (``<EMAIL_1>`` is written between single guillemets instead, see ``_DEFANGED``): it can
    never resolve to, or reveal, a user's value."""
    if "<" not in text:
        return text
    return PLACEHOLDER.sub(
        lambda match: match.group(0) if match.group(0) in keep else _defanged(match), text
    )


def _defanged(match: re.Match[str]) -> str:
    return _DEFANGED.format(match.group(0)[1:-1])


class NoVault:
    """What stands for the vault where placeholders are written but no vault keeps their
    values (masking on, no PII key): no placeholder resolves, so a tool call that holds one is
    not made, and the deployment is told once, in one warning, that its vault is off."""

    def __init__(self) -> None:
        self._warned = False

    def refusal(self, placeholder: str) -> PlaceholderError:
        """Why a call holding ``placeholder`` is not made (warns the first time)."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "a tool call held the placeholder %s and was not made: this agent masks PII "
                "without a vault (no KEEL_PII_KEY or key file), so no placeholder stands for a "
                "value any more; give it a PII key for tools to get the user's values",
                placeholder,
            )
        return PlaceholderError(
            placeholder, "this agent keeps no PII vault, so its values are gone"
        )


@dataclass(frozen=True)
class StoredKey:
    """A data key as stored: wrapped by the master key named ``key_id``."""

    wrapped: bytes
    key_id: str


class VaultStore(ABC):
    """Where the vault keeps wrapped data keys and sealed values; every method is scoped to
    one ``(tenant_id, user_id)`` and never sees a key or a value in the clear.

    A value row is ``(tenant_id, user_id, entity, number, token, sealed)``: ``token`` is the
    value's HMAC (unique per user), ``number`` counts per user and entity from 1 and is never
    reused, not even after ``forget`` (a new value must not take a forgotten value's
    placeholder, which histories still hold).

    Sync/async contract: every method is blocking and thread-safe, with no async twins. A
    caller on an event loop hands a whole unit of work (a message masked: several reads and a
    write) to [`acall`][], which runs it the way the store should: on keel's blocking pool by
    default, inline on SQLite unless it would wait (the database's own rule).
    """

    @abstractmethod
    def key_checks(self) -> list[StoredKey]:
        """The sealed checks, one per master key this vault accepts (a key with no check is
        refused); two while a rotation is under way, none before the first use."""

    @abstractmethod
    def add_key_check(self, check: StoredKey) -> bool:
        """Store ``check`` unless its master key (``check.key_id``) has one; True if stored."""

    @abstractmethod
    def drop_key_check(self, key_id: str) -> bool:
        """Delete the check of master key ``key_id``, in one statement with the proof that no
        data key is wrapped by it any more; False (nothing deleted) while one still is."""

    @abstractmethod
    def wrapped_by(self, key_id: str) -> int:
        """How many data keys master key ``key_id`` wraps."""

    @abstractmethod
    def data_key(self, tenant_id: str, user_id: str) -> StoredKey | None:
        """The user's wrapped data key (None: none yet, or forgotten)."""

    @abstractmethod
    def add_data_key(self, tenant_id: str, user_id: str, key: StoredKey) -> StoredKey | None:
        """Store ``key`` as the user's data key unless they have one; the one that stands.
        None, storing nothing, when the master key that wraps it (``key.key_id``) has no key
        check: a process still running with a key rotated away must not wrap new data keys
        that the vault's keys cannot open (the check is read under a shared lock, so a
        [`drop_key_check`][] racing this waits for it and then sees the key)."""

    @abstractmethod
    def numbers(
        self, tenant_id: str, user_id: str, tokens: Sequence[bytes]
    ) -> dict[bytes, tuple[str, int]]:
        """``token -> (entity, number)`` for the user's values among ``tokens``."""

    @abstractmethod
    def add_value(
        self,
        tenant_id: str,
        user_id: str,
        entity: str,
        token: bytes,
        sealed: bytes,
        *,
        key: StoredKey,
    ) -> int | None:
        """Store a value under the next number of ``entity`` for the user and return it; the
        existing number when ``token`` is already stored (a racing writer's). None when the
        user's data key is no longer ``key`` (forgotten meanwhile): nothing is stored."""

    def add_values(
        self,
        tenant_id: str,
        user_id: str,
        values: Sequence[tuple[str, bytes, bytes]],
        *,
        key: StoredKey,
    ) -> list[int] | None:
        """[`add_value`][] for each ``(entity, token, sealed)`` of ``values``: their numbers,
        in order (a token stored already, or given twice, keeps one number). None when the
        user's data key is not ``key``. A store overrides it to place them all in one
        transaction, comparing the key once; this one places them one by one."""
        numbers: list[int] = []
        for entity, token, sealed in values:
            number = self.add_value(tenant_id, user_id, entity, token, sealed, key=key)
            if number is None:
                return None
            numbers.append(number)
        return numbers

    @abstractmethod
    def sealed(
        self, tenant_id: str, user_id: str, refs: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[bytes, bytes] | None]:
        """``(entity, number) -> (token, sealed)`` for the refs the user has; None for a
        forgotten one; refs the user never had are left out."""

    @abstractmethod
    def forget(self, tenant_id: str, user_id: str) -> int:
        """Delete the user's data key and every token and sealed value of theirs, keeping only
        the numbers (so they are never reused); the number of values erased."""

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Delete the user's data key and every row of their values, numbers included (a
        user's whole erasure, their histories gone too: no placeholder of theirs is left to
        resolve); ``{"pii_keys": ..., "pii_values": ...}``. Idempotent. This default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot erase a user")

    @abstractmethod
    def data_keys(self) -> Iterator[tuple[str, str, StoredKey]]:
        """Every ``(tenant_id, user_id, key)`` (for re-wrapping under a new master key)."""

    @abstractmethod
    def rewrap(self, tenant_id: str, user_id: str, old: StoredKey, new: StoredKey) -> bool:
        """Replace the user's data key ``old`` with ``new`` (compare-and-set on ``old``)."""

    def close(self) -> None:  # noqa: B027 - most stores hold nothing of their own
        """Release what the store holds (the database is closed by its owner)."""

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` (blocking work on this store) for an event loop: on the bridge's pool
        of blocking threads (a round trip to a server must not stall the loop). A store whose
        calls take microseconds and wait for no one may run them inline instead."""
        return await run_blocking(call)


class Vault:
    """The deployment's PII vault: a [`VaultStore`][] and the master key's provider.

    Args:
        store: where wrapped keys and sealed values live.
        keys: the master key (``MasterKey``, or a KMS-backed [`KeyProvider`][]), or a
            [`KeyRing`][]: the current key and the previous ones a rotation under way
            still needs (each data key row names the master key that wraps it).

    [`check`][] (run by the opener at start-up) proves the keys are the vault's.

    The vault keeps one sealed check per master key it accepts. A rotation seals the new
    key's check first, re-wraps the data keys one by one (each a compare-and-set), and drops
    the old key's check last, in one statement with the proof that no data key is wrapped by
    it any more. Killed anywhere, the vault is consistent: every data key is wrapped by a key
    that has a check, and rerunning the rotation with either key finishes it.
    """

    def __init__(self, store: VaultStore, keys: KeyProvider | KeyRing) -> None:
        self.store = store
        self.ring = KeyRing.of(keys)

    @property
    def keys(self) -> KeyProvider:
        """The current master key: the one that wraps new data keys."""
        return self.ring.current

    def check(self) -> None:
        """Prove the master keys open this vault (seal the current key's check on first use),
        and that every user is served: a rotation left half done needs both its keys.

        Raises:
            VaultKeyError: the current key is not one of the vault's, a key fails its check,
                or data keys are still wrapped by a key of the vault's that was not given.
        """
        checks = {check.key_id: check for check in self.store.key_checks()}
        current = self.keys
        if not checks:
            if self.store.add_key_check(_sealed_check(current)):
                return
            checks = {check.key_id: check for check in self.store.key_checks()}
        if current.key_id not in checks:
            raise VaultKeyError(
                f"the PII master key ({current.key_id}) is not this vault's (its data keys are "
                f"wrapped by {_named(checks)})"
            )
        accepted = [key for key in self.ring if key.key_id in checks]
        for key in accepted:
            _open_check(key, checks[key.key_id])
        # A previous key the vault no longer accepts (its rotation finished) never unwraps.
        self.ring = KeyRing(current, [key for key in accepted if key is not current])
        for key_id in checks.keys() - {key.key_id for key in accepted}:
            waiting = self.store.wrapped_by(key_id)
            if waiting:
                raise VaultKeyError(
                    f"a PII key rotation between master keys {current.key_id} and {key_id} is "
                    f"unfinished: {waiting} data keys are still wrapped by {key_id}, which was "
                    "not given. Give it too (KEEL_PII_KEY_PREVIOUS, or KEEL_PII_KEY with this "
                    "one as KEEL_PII_KEY_PREVIOUS), or finish the rotation with `keel privacy "
                    "rotate-key` (--new-key-... or --old-key-...)"
                )

    def unwrap(self, stored: StoredKey, context: bytes) -> bytes:
        """The data key ``stored`` wraps, opened by the master key its row names.

        Raises:
            VaultKeyError: that key is not in the ring, or does not open ``stored``.
        """
        provider = self.ring.provider(stored.key_id)
        if provider is None:
            raise VaultKeyError(
                f"a data key is wrapped by PII master key {stored.key_id}, which this process "
                f"was not given (it runs with {self.keys.key_id}): finish the key rotation "
                "with `keel privacy rotate-key`, or give that key as KEEL_PII_KEY_PREVIOUS"
            )
        return provider.unwrap(stored.wrapped, context)

    def user(self, tenant_id: str, user_id: str) -> UserVault:
        """The vault as one tenant's user sees it (their placeholders only)."""
        if not tenant_id or not user_id:
            raise PlaceholderError("<vault>", "a vault view needs a tenant and a user")
        return UserVault(self, tenant_id, user_id)

    def forget(self, tenant_id: str, user_id: str) -> int:
        """Erase the user's data key and values (their placeholders resolve to nothing from
        now on, in every process); the number of values erased.

        The rows are gone from the database; copies the database itself keeps (PostgreSQL's
        write-ahead log, its replicas and backups) still hold the wrapped data key and the
        sealed values until the master key that wrapped that data key is rotated away
        ([`rotate`][]) and destroyed: only then is the erasure final everywhere."""
        return self.store.forget(tenant_id, user_id)

    def rotate(self, new_keys: KeyProvider) -> int:
        """Re-wrap every data key under ``new_keys``, resumably; the number re-wrapped by this
        call. Values are not re-encrypted: their data keys do not change. Afterwards only
        ``new_keys`` opens the vault (the others' checks are dropped).

        Killed at any point, rerun it (with the ring it had, or with ``new_keys`` as the
        current key and the old one as previous) and it finishes.

        Raises:
            VaultKeyError: a key of the ring fails its check, a data key is wrapped by a key
                the ring does not hold, or writers kept wrapping data keys under an old key.
        """
        self.check()
        new_check = _sealed_check(new_keys)
        # 1. The new key is accepted before any data key is wrapped by it.
        if not self.store.add_key_check(new_check):
            stored = {check.key_id: check for check in self.store.key_checks()}
            _open_check(new_keys, stored[new_keys.key_id])
        self.ring = KeyRing(new_keys, [key for key in self.ring if key is not new_keys])
        rewrapped = 0
        for _ in range(_ROTATION_PASSES):
            # 2. Each data key re-wrapped by itself, a compare-and-set: a key forgotten or
            # re-wrapped meanwhile is left as it now is.
            for tenant_id, user_id, old in self.store.data_keys():
                if old.key_id == new_keys.key_id:
                    continue
                context = _owner(tenant_id, user_id)
                new = StoredKey(new_keys.wrap(self.unwrap(old, context), context), new_keys.key_id)
                rewrapped += self.store.rewrap(tenant_id, user_id, old, new)
            # 3. The old keys' checks last: refused by the store while a data key is still
            # wrapped by one (a process that still runs with it wrote one meanwhile).
            left = [
                check.key_id
                for check in self.store.key_checks()
                if check.key_id != new_keys.key_id and not self.store.drop_key_check(check.key_id)
            ]
            if not left:
                self.ring = KeyRing(new_keys)
                return rewrapped
        raise VaultKeyError(
            f"data keys kept being wrapped by master key {', '.join(left)} during the rotation: "
            "restart keel's processes with the new key (the old one as KEEL_PII_KEY_PREVIOUS), "
            "then run the rotation again to finish it"
        )


_ROTATION_PASSES = 3
"""Passes over the data keys a rotation makes before it gives up on writers that still wrap
new users' keys under an old master key."""


def _sealed_check(keys: KeyProvider) -> StoredKey:
    return StoredKey(keys.wrap(_CHECK_PLAINTEXT, _owner(_CHECK_TENANT, _CHECK_USER)), keys.key_id)


def _open_check(keys: KeyProvider, check: StoredKey) -> None:
    try:
        opened = keys.unwrap(check.wrapped, _owner(_CHECK_TENANT, _CHECK_USER))
    except VaultKeyError as exc:
        raise VaultKeyError(
            f"the PII master key named {keys.key_id} does not open this vault's check for "
            "that key (a different key under the same name)"
        ) from exc
    if opened != _CHECK_PLAINTEXT:
        raise VaultKeyError("the vault's key check does not match")


def _named(checks: dict[str, StoredKey]) -> str:
    return " and ".join(sorted(checks)) or "no key yet"


class UserVault:
    """One tenant's user's view of the vault, for one unit of work (a turn, a call).

    It holds the user's data key while it lives (created on the first value); placeholders it
    has looked up are remembered by token. The values the unit of work gave it to place are
    kept with their placeholders for the view's life (the unit holds them in its own texts:
    its tool calls and its reply resolve them without a read of the store); any other value
    is read sealed from the store each time it is resolved, so a ``forget`` elsewhere takes
    effect at once for those, and for every value in the next unit of work.

    Once the unit of work has shown the model a prompt ([`note_shown`][]), the view resolves
    and reveals only the placeholders it placed or showed (see the module docstring): the
    others are *foreign*, written by a tool, a document or a model, and stand for nothing.
    """

    def __init__(self, vault: Vault, tenant_id: str, user_id: str) -> None:
        self.vault = vault
        self.tenant_id = tenant_id
        self.user_id = user_id
        self._context = _owner(tenant_id, user_id)
        self._key: tuple[StoredKey, bytes] | None = None
        self._numbers: dict[bytes, str] = {}
        """token -> placeholder, for the values this view has already placed."""
        self._given: dict[str, str] = {}
        """placeholder -> value, for the values this unit of work gave the view to place."""
        self._cipher: tuple[bytes, AESGCM, Any] | None = None
        """The data key's AES-GCM and keyed HMAC, built once for the view (not per value)."""
        self._placed: set[str] = set()
        """The placeholders this view placed (values masked in this unit of work)."""
        self._shown: set[str] | None = None
        """The placeholders in what the model was shown; None until it was shown anything:
        before that, nothing the model wrote in this unit of work is being resolved (a call a
        person approved, a reply recorded with its foreign placeholders defanged)."""
        self._scanned: set[str] = set()
        """The texts [`note_shown`][] has scanned (masked texts: placeholders, no values)."""

    # --- what this unit of work may resolve -----------------------------------------------------

    def note_shown(self, texts: Iterable[str]) -> None:
        """The model is shown ``texts`` (a compiled prompt): from now on this view resolves
        and reveals only the placeholders it placed and those in texts shown to the model."""
        shown = self._shown if self._shown is not None else set()
        scanned = self._scanned
        for text in texts:
            # A turn's later prompts repeat its earlier ones: each text is scanned once.
            if "<" in text and text not in scanned:
                shown.update(_PLACEHOLDER_TEXT.findall(text))
                scanned.add(text)
        self._shown = shown

    def note_placeholders_shown(self, placeholders: Iterable[str]) -> None:
        """[`note_shown`][] of a prompt whose placeholders are known already (a compiled
        prompt keeps them as its history grows, see
        [`CompiledPrompt`][keel.context.CompiledPrompt]): the model is shown exactly
        ``placeholders``, and no text is scanned again."""
        if self._shown is None:
            self._shown = set(placeholders)
        else:
            self._shown.update(placeholders)

    def is_foreign(self, placeholder: str) -> bool:
        """Whether ``placeholder`` came from text keel did not write: neither placed by this
        view nor shown to the model (never, before the model was shown anything)."""
        shown = self._shown
        return shown is not None and placeholder not in shown and placeholder not in self._placed

    def defang_foreign(self, text: str) -> str:
        """``text`` (what a model or a tool wrote) with its foreign placeholders defanged
        ([`defang_placeholders`][]); the others stay placeholders."""
        if self._shown is None or "<" not in text:
            return text
        return PLACEHOLDER.sub(
            lambda match: _defanged(match) if self.is_foreign(match.group(0)) else match.group(0),
            text,
        )

    # --- values -> placeholders -----------------------------------------------------------------

    def placeholder(self, entity: str, value: str) -> str:
        """The user's placeholder for ``value`` (stored sealed on first sight)."""
        return self.placeholders([(entity, value)])[0]

    def placeholders(self, values: Sequence[tuple[str, str]]) -> list[str]:
        """The user's placeholder for each ``(entity, value)``, in order: one look-up of the
        store for those this view has not placed yet, and the new ones stored sealed in one
        write (a text's findings, placed at once)."""
        if not values:
            return []
        for _ in range(3):
            stored, data_key = self._writing_key()
            tokens = [self._token(data_key, entity, value) for entity, value in values]
            unplaced = [token for token in dict.fromkeys(tokens) if token not in self._numbers]
            if unplaced:
                found = self.vault.store.numbers(self.tenant_id, self.user_id, unplaced)
                for token, (entity, number) in found.items():
                    self._remember(token, entity, number)
            new = {
                token: (entity, value)
                for token, (entity, value) in zip(tokens, values, strict=True)
                if token not in self._numbers
            }
            if new and not self._add(stored, data_key, new):
                # The user was forgotten meanwhile: a new data key, and the values under it.
                self._forget_key()
                continue
            placed = [self._numbers[token] for token in tokens]
            for placeholder, (_, value) in zip(placed, values, strict=True):
                self._given[placeholder] = value
            return placed
        raise PlaceholderError(f"<{values[0][0]}_?>", "the user's data key kept changing")

    def _add(self, stored: StoredKey, data_key: bytes, new: dict[bytes, tuple[str, str]]) -> bool:
        """Store the ``token -> (entity, value)`` not stored yet, sealed, in one write, and
        remember their placeholders; False when ``stored`` is no longer the user's key."""
        sealed = [
            (entity, token, self._seal(data_key, token, value))
            for token, (entity, value) in new.items()
        ]
        numbers = self.vault.store.add_values(self.tenant_id, self.user_id, sealed, key=stored)
        if numbers is None:
            return False
        for (entity, token, _), number in zip(sealed, numbers, strict=True):
            self._remember(token, entity, number)
        return True

    # --- placeholders -> values -----------------------------------------------------------------

    def values(self, placeholders: Iterable[str]) -> dict[str, str]:
        """Each of ``placeholders`` with its value (one read of the store for them all).

        Raises:
            PlaceholderError: one is not the user's, was forgotten, fails to decrypt, or is
                foreign (see [`is_foreign`][]; it names the placeholder).
        """
        refs: dict[str, tuple[str, int]] = {}
        for placeholder in dict.fromkeys(placeholders):
            match = PLACEHOLDER.fullmatch(placeholder)
            if match is None:
                raise PlaceholderError(placeholder, "not a placeholder")
            if self.is_foreign(placeholder):
                raise PlaceholderError(placeholder, FOREIGN_REASON)
            refs[placeholder] = (match.group(1), int(match.group(2)))
        opened: dict[str, str] = {}
        for placeholder, value in self._opened(refs).items():
            if isinstance(value, PlaceholderError):
                raise value
            opened[placeholder] = value
        return opened

    def _opened(self, refs: dict[str, tuple[str, int]]) -> dict[str, str | PlaceholderError]:
        """Each placeholder of ``refs`` with its value, or the error that says why it has
        none: a value given to this view to place from the view, the others read sealed from
        the store in one call."""
        opened: dict[str, str | PlaceholderError] = {}
        unread: dict[str, tuple[str, int]] = {}
        for placeholder, ref in refs.items():
            given = self._given.get(placeholder)
            if given is None:
                unread[placeholder] = ref
            else:
                opened[placeholder] = given
        if not unread:
            return opened
        rows = self.vault.store.sealed(self.tenant_id, self.user_id, list(unread.values()))
        for placeholder, ref in unread.items():
            row = rows.get(ref)
            key = None if row is None else self._reading_key()
            if ref not in rows:
                opened[placeholder] = PlaceholderError(placeholder, "no such value for this user")
            elif row is None or key is None:
                opened[placeholder] = PlaceholderError(placeholder, "the value was erased (forget)")
            else:
                try:
                    opened[placeholder] = self._open(key[1], placeholder, *row)
                except PlaceholderError as exc:
                    opened[placeholder] = exc
        return opened

    def resolve(self, text: str) -> str:
        """``text`` with every placeholder replaced by its value.

        Raises:
            PlaceholderError: a placeholder in it cannot be resolved (nothing is guessed).
        """
        found = placeholders_in(text)
        if not found:
            return text
        values = self.values(found)
        return PLACEHOLDER.sub(lambda match: values[match.group(0)], text)

    def reveal(self, text: str) -> str:
        """``text`` with the user's own placeholders replaced by their values; any other
        placeholder (unknown, erased, undecryptable, foreign) is left as written. A JSON text
        stays JSON: a value revealed inside one of its strings is written escaped (a private
        key's line breaks as ``\\n``; see `keel.privacy._json_strings`)."""
        found = placeholders_in(text)
        if not found:
            return text
        refs = {
            match.group(0): (match.group(1), int(match.group(2)))
            for match in map(PLACEHOLDER.fullmatch, found)
            if match is not None and not self.is_foreign(match.group(0))
        }
        values = {
            placeholder: value
            for placeholder, value in self._opened(refs).items()
            if isinstance(value, str)
        }
        strings = (
            JsonStrings().spans(text)
            if any(_NEEDS_JSON_ESCAPE.search(value) for value in values.values())
            else []
        )

        def shown(match: re.Match[str]) -> str:
            value = values.get(match.group(0))
            if value is None:
                return match.group(0)
            return json_escaped(value) if inside(strings, match.start()) else value

        return PLACEHOLDER.sub(shown, text)

    def resolve_arguments(self, arguments: str, *, keep: Iterable[str] = ()) -> str:
        """A tool call's JSON arguments with placeholders resolved in every string value,
        except under the top-level names in ``keep`` (they stay masked); text that is not
        JSON is returned as it is (the call's validation reports it).

        Raises:
            PlaceholderError: as [`resolve`][].
        """
        if not PLACEHOLDER.search(arguments):
            return arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        kept = frozenset(keep)
        if isinstance(parsed, dict):
            resolved: Any = {
                name: value if name in kept else self._resolve_value(value)
                for name, value in parsed.items()
            }
        else:
            resolved = self._resolve_value(parsed)
        return json.dumps(resolved, ensure_ascii=False)

    def _resolve_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.resolve(value)
        if isinstance(value, list):
            return [self._resolve_value(item) for item in value]
        if isinstance(value, dict):
            return {name: self._resolve_value(item) for name, item in value.items()}
        return value

    # --- keys and sealing -----------------------------------------------------------------------

    def _reading_key(self) -> tuple[StoredKey, bytes] | None:
        """The user's data key, if they have one."""
        if self._key is None:
            stored = self.vault.store.data_key(self.tenant_id, self.user_id)
            if stored is None:
                return None
            self._key = (stored, self.vault.unwrap(stored, self._context))
        return self._key

    def _writing_key(self) -> tuple[StoredKey, bytes]:
        """The user's data key, created on their first value."""
        key = self._reading_key()
        if key is None:
            keys = self.vault.keys
            fresh = StoredKey(keys.wrap(secrets.token_bytes(KEY_BYTES), self._context), keys.key_id)
            stored = self.vault.store.add_data_key(self.tenant_id, self.user_id, fresh)
            if stored is None:
                # No check for this key: a vault used before its check (which seals the first),
                # or a key rotated away (which the check refuses, saying so).
                self.vault.check()
                stored = self.vault.store.add_data_key(self.tenant_id, self.user_id, fresh)
            if stored is None:
                raise VaultKeyError(
                    f"the PII master key {keys.key_id} is no longer this vault's (a key rotation "
                    "moved it away): restart keel with the new key"
                )
            key = self._key = (stored, self.vault.unwrap(stored, self._context))
        return key

    def _forget_key(self) -> None:
        self._key = None
        self._cipher = None
        self._numbers.clear()
        self._given.clear()

    def _ciphers(self, data_key: bytes) -> tuple[AESGCM, Any]:
        """AES-GCM and the HMAC under ``data_key`` (its key schedule and padded key computed
        once: a turn seals and tokenizes tens of values)."""
        if self._cipher is None or self._cipher[0] != data_key:
            self._cipher = (data_key, AESGCM(data_key), hmac.new(data_key, None, hashlib.sha256))
        return self._cipher[1], self._cipher[2]

    def _token(self, data_key: bytes, entity: str, value: str) -> bytes:
        mac = self._ciphers(data_key)[1].copy()
        mac.update(entity.encode() + b"\x00" + value.encode("utf-8", "surrogatepass"))
        return bytes(mac.digest())

    def _remember(self, token: bytes, entity: str, number: int) -> str:
        placeholder = f"<{entity}_{number}>"
        self._numbers[token] = placeholder
        self._placed.add(placeholder)
        return placeholder

    def _seal(self, data_key: bytes, token: bytes, value: str) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        aad = self._context + b"\x00" + token
        sealed = self._ciphers(data_key)[0].encrypt(
            nonce, value.encode("utf-8", "surrogatepass"), aad
        )
        return nonce + sealed

    def _open(self, data_key: bytes, placeholder: str, token: bytes, sealed: bytes) -> str:
        aad = self._context + b"\x00" + token
        try:
            plain = self._ciphers(data_key)[0].decrypt(
                sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], aad
            )
        except (InvalidTag, ValueError) as exc:
            raise PlaceholderError(placeholder, "its sealed value fails to decrypt") from exc
        return plain.decode("utf-8", "surrogatepass")


def _owner(tenant_id: str, user_id: str) -> bytes:
    """What a wrapped key and a sealed value are bound to: their tenant and user."""
    return json.dumps([tenant_id, user_id]).encode()


_NEEDS_JSON_ESCAPE = re.compile(r'["\\\x00-\x1f]')
"""A character a JSON string holds only escaped."""
