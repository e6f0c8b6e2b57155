"""The PII vault's master key: what wraps each tenant's and user's data key.

keel never stores the master key. It comes from the deployment: ``KEEL_PII_KEY`` (32 random
bytes, base64 or hex), a key file (``KEEL_PII_KEY_FILE``), or any [`KeyProvider`][] (a KMS
client that wraps and unwraps data keys without ever handing out the master key). The data keys
it wraps are what the vault encrypts values under; destroying one (``forget``) makes that
user's values unrecoverable even to whoever holds the master key and a copy of the database.

A key file is refused when its group or others may read it (as ssh refuses such a private
key), and no error message ever quotes a byte of a key. During a key rotation a
[`KeyRing`][] holds the current key (which wraps) and the previous ones (which only unwrap
the rows that still name them).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from keel.errors import VaultKeyError

__all__ = [
    "KEY_BYTES",
    "KeyProvider",
    "KeyRing",
    "MasterKey",
    "embedded_key",
    "key_provider_from_env",
    "private_file_only",
    "write_key_file",
]

logger = logging.getLogger("keel.privacy")

KEY_BYTES = 32
"""AES-256: the master key and every data key."""

_NONCE_BYTES = 12
_WRAP_VERSION = b"\x01"
"""The first byte of a wrapped key: how it was wrapped, so the format can change later."""


@runtime_checkable
class KeyProvider(Protocol):
    """Wraps and unwraps data keys under a master key the provider keeps to itself.

    ``context`` binds a wrapped key to its owner (the tenant and user): a wrapped key copied to
    another user's row does not unwrap. A KMS-backed provider passes it as the encryption
    context / additional authenticated data."""

    @property
    def key_id(self) -> str:
        """A public, stable name of the master key (never the key): which key wrapped a row."""
        ...

    def wrap(self, data_key: bytes, context: bytes) -> bytes:
        """``data_key`` encrypted under the master key, bound to ``context``."""
        ...

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        """The data key ``wrap`` was given.

        Raises:
            VaultKeyError: ``wrapped`` was not wrapped by this master key for ``context``.
        """
        ...


class MasterKey:
    """A 256-bit master key held in this process, wrapping data keys with AES-256-GCM.

    Example:
        >>> key = MasterKey.generate()
        >>> key.unwrap(key.wrap(b"k" * 32, b"acme/alice"), b"acme/alice") == b"k" * 32
        True
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise VaultKeyError(f"a PII master key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        # A name for the key that reveals nothing about it: an HMAC under the key itself.
        self._key_id = hmac.new(key, b"keel pii master key id", hashlib.sha256).hexdigest()[:16]

    @classmethod
    def generate(cls) -> MasterKey:
        """A new random key (``export`` it to keep it)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @staticmethod
    def new_key_text() -> str:
        """A new random key as ``KEEL_PII_KEY`` takes it (URL-safe base64)."""
        return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")

    @classmethod
    def from_text(cls, text: str, *, source: str = "the PII key") -> MasterKey:
        """A key written as base64 (standard or URL-safe) or hex.

        Raises:
            VaultKeyError: ``text`` is not 32 bytes in any of those encodings (``source`` says
                where it came from; the text itself is never repeated).
        """
        raw = _decode_key(text.strip())
        if raw is None:
            raise VaultKeyError(
                f"{source} is not a {KEY_BYTES}-byte key in base64 or hex "
                "(make one with `keel privacy new-key`)"
            )
        return cls(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> MasterKey:
        """The key written in ``path`` (as [`from_text`][] reads it).

        Raises:
            VaultKeyError: the file is missing, unreadable, readable by its group or others
                (``chmod 600`` it), or not a key.
        """
        shown = repr(str(path))
        try:
            private_file_only(path)
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise VaultKeyError(f"cannot read the PII key file {shown}: {exc.strerror}") from None
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            # Never the decoder's own message: it quotes the offending byte, a byte of the key.
            raise VaultKeyError(
                f"the PII key file {shown} is not text: a key is written in base64 or hex "
                "(make one with `keel privacy new-key --file PATH`)"
            ) from None
        return cls.from_text(text, source=f"the PII key file {shown}")

    @property
    def key_id(self) -> str:
        return self._key_id

    def wrap(self, data_key: bytes, context: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return _WRAP_VERSION + nonce + self._aead.encrypt(nonce, data_key, context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        if len(wrapped) < 1 + _NONCE_BYTES or wrapped[:1] != _WRAP_VERSION:
            raise VaultKeyError("a wrapped data key in an unknown format")
        nonce, sealed = wrapped[1 : 1 + _NONCE_BYTES], wrapped[1 + _NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, sealed, context)
        except InvalidTag as exc:
            raise VaultKeyError(
                "the PII master key does not open this vault's data keys (a wrong key, or a "
                "key that was rotated away)"
            ) from exc

    def __repr__(self) -> str:
        return f"MasterKey(key_id={self._key_id!r})"


class KeyRing:
    """The master key that wraps (``current``) and the ones that only unwrap (``previous``):
    what a deployment runs with while a rotation is under way, so that every user is served
    whichever key their data key is still wrapped by.

    Example:
        >>> old, new = MasterKey.generate(), MasterKey.generate()
        >>> ring = KeyRing(new, [old])
        >>> ring.current is new and ring.provider(old.key_id) is old
        True
    """

    def __init__(self, current: KeyProvider, previous: Iterable[KeyProvider] = ()) -> None:
        self.current = current
        self._providers: dict[str, KeyProvider] = {}
        for provider in (current, *previous):
            self._providers.setdefault(provider.key_id, provider)

    @classmethod
    def of(cls, keys: KeyProvider | KeyRing) -> KeyRing:
        """``keys`` as a ring (a single key: a ring of one)."""
        return keys if isinstance(keys, KeyRing) else cls(keys)

    @property
    def previous(self) -> list[KeyProvider]:
        """The keys besides the current one."""
        return [key for key in self._providers.values() if key is not self.current]

    def provider(self, key_id: str) -> KeyProvider | None:
        """The key named ``key_id``, if the ring holds it."""
        return self._providers.get(key_id)

    def __iter__(self) -> Iterator[KeyProvider]:
        return iter(self._providers.values())

    def __repr__(self) -> str:
        return f"KeyRing(current={self.current.key_id!r}, previous={list(self._providers)[1:]!r})"


def private_file_only(path: str | Path) -> None:
    """Refuse a key file that its group or others may read or write (ssh's rule for a
    private key); nothing to check where the platform has no such modes.

    Raises:
        VaultKeyError: the file's mode lets others in.
        OSError: the file cannot be read.
    """
    mode = Path(path).stat().st_mode
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        raise VaultKeyError(
            f"the PII key file {str(path)!r} is open to its group or others (mode "
            f"{stat.S_IMODE(mode):04o}): a master key must be private to its owner; run "
            f"`chmod 600 {path}`"
        )


def write_key_file(path: str | Path, text: str) -> None:
    """Write ``text`` (a key) as a new file at ``path``, mode 0600, whole or not at all: it
    is written to a private temporary file beside it, then linked into place, which fails if
    ``path`` exists (a key is never overwritten: that would lose every value it opens), so a
    racing reader never sees half a key.

    Raises:
        FileExistsError: ``path`` exists.
        OSError: the directory cannot be written.
    """
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as out:
            out.write(text + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def embedded_key(path: Path) -> MasterKey:
    """The embedded database's master key, kept in ``path``: made on first use (one INFO
    line names the file, never the key), read ever after. Two processes starting at once
    agree on one key: the file appears whole or not at all, and the one that finds it made
    reads the other's.

    Raises:
        VaultKeyError: the file cannot be made or read, or is not a private key file.
    """
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_key_file(path, MasterKey.new_key_text())
        except FileExistsError:
            pass  # another process made it first: its key is the one
        except OSError as exc:
            raise VaultKeyError(
                f"cannot create the PII key file {str(path)!r}: {exc.strerror} (set "
                "KEEL_PII_KEY or KEEL_PII_KEY_FILE, or KEEL_PII_VAULT=off for masking only)"
            ) from None
        else:
            logger.info(
                "created the PII vault's master key for the embedded database in %s (mode "
                "0600): keep it and a copy of it, without it no value in the vault opens",
                path,
            )
    return MasterKey.from_file(path)


def key_provider_from_env(environ: Mapping[str, str] | None = None) -> MasterKey | None:
    """The master key the environment gives: ``KEEL_PII_KEY``, else ``KEEL_PII_KEY_FILE``;
    None when neither is set (the vault is off).

    Raises:
        VaultKeyError: a variable is set but holds no usable key (never ignored).
    """
    env = os.environ if environ is None else environ
    text = env.get("KEEL_PII_KEY", "")
    if text.strip():
        return MasterKey.from_text(text, source="KEEL_PII_KEY")
    path = env.get("KEEL_PII_KEY_FILE", "")
    if path.strip():
        return MasterKey.from_file(path.strip())
    if "KEEL_PII_KEY" in env:
        raise VaultKeyError("KEEL_PII_KEY is set but empty")
    return None


def _decode_key(text: str) -> bytes | None:
    candidates: list[bytes] = []
    if len(text) == 2 * KEY_BYTES:
        with contextlib.suppress(ValueError):
            candidates.append(bytes.fromhex(text))
    padded = text + "=" * (-len(text) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        with contextlib.suppress(binascii.Error, ValueError, UnicodeEncodeError):
            candidates.append(decode(padded.encode("ascii")))
    return next((raw for raw in candidates if len(raw) == KEY_BYTES), None)
