"""PII and secret masking, shared by memory, traces and checkpoints.

[`PIIMasker`][] replaces emails, phone numbers, payment cards (Luhn-checked), US SSNs,
IBANs (mod-97 checked), IP addresses and API keys / tokens (``sk-...``, ``AKIA...``,
``ghp_...``, JWTs, bearer tokens, PEM private keys) with typed placeholders such as
``<EMAIL_1>``, under a policy that can differ per tenant. [`mask_pii`][] is the one-liner;
[`DEFAULT_MASKER`][] is the default policy every part of keel shares unless given its own.
[`StreamMasker`][] masks a text that arrives in pieces (a streamed reply);
[`RevealStream`][] reveals a user's placeholders in one, never splitting a placeholder.

With a [`Vault`][] (a master key from ``KEEL_PII_KEY``, a key file or a
[`KeyProvider`][]), placeholders are stable per tenant and user and the values are kept
sealed, so tools get them back ([`UserVault.resolve_arguments`][]) and the user reads them
([`UserVault.reveal`][]), while everything persisted holds placeholders only. Only the
placeholders keel placed are resolved or revealed: [`defang_placeholders`][] neutralises
placeholder-shaped text from tools and documents, and [`UserVault.note_shown`][] limits a
unit of work to the placeholders the model was shown; [`NoVault`][] refuses them all.

[`privacy_view`][] gives the one object every part of keel masks and reveals a user's text
through, for one unit of work (a turn, a request, an adapter's call): a [`PrivacyView`][],
numbered through the user's vault when there is one.
"""

from __future__ import annotations

from keel.privacy._detectors import Detector, Finding
from keel.privacy._keys import KeyProvider, KeyRing, MasterKey, key_provider_from_env
from keel.privacy._masker import (
    DEFAULT_MASKER,
    ENTITY_TYPES,
    BatchNumbering,
    MaskingPolicy,
    MaskResult,
    Numbering,
    PIIMasker,
    mask_pii,
    maskable_json,
)
from keel.privacy._stream import RevealStream, StreamMasker
from keel.privacy._vault import (
    PLACEHOLDER,
    NoVault,
    StoredKey,
    UserVault,
    Vault,
    VaultStore,
    defang_placeholders,
    placeholders_in,
)
from keel.privacy._view import PrivacyView, message_placeholders, privacy_view, storable

__all__ = [
    "DEFAULT_MASKER",
    "ENTITY_TYPES",
    "PLACEHOLDER",
    "BatchNumbering",
    "Detector",
    "Finding",
    "KeyProvider",
    "KeyRing",
    "MaskResult",
    "MaskingPolicy",
    "MasterKey",
    "NoVault",
    "Numbering",
    "PIIMasker",
    "PrivacyView",
    "RevealStream",
    "StoredKey",
    "StreamMasker",
    "UserVault",
    "Vault",
    "VaultStore",
    "defang_placeholders",
    "key_provider_from_env",
    "mask_pii",
    "maskable_json",
    "message_placeholders",
    "placeholders_in",
    "privacy_view",
    "storable",
]
