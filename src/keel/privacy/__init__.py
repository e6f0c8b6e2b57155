"""PII and secret masking, shared by memory, traces and checkpoints.

:class:`PIIMasker` replaces emails, phone numbers, payment cards (Luhn-checked), US SSNs,
IBANs (mod-97 checked), IP addresses and API keys / tokens (``sk-...``, ``AKIA...``,
``ghp_...``, JWTs, bearer tokens, PEM private keys) with typed placeholders such as
``<EMAIL_1>``, under a policy that can differ per tenant. :func:`mask_pii` is the one-liner;
:data:`DEFAULT_MASKER` is the default policy every part of keel shares unless given its own.
:class:`StreamMasker` masks a text that arrives in pieces (a streamed reply).
"""

from __future__ import annotations

from keel.privacy._detectors import Detector, Finding
from keel.privacy._masker import (
    DEFAULT_MASKER,
    ENTITY_TYPES,
    MaskingPolicy,
    MaskResult,
    PIIMasker,
    mask_pii,
)
from keel.privacy._stream import StreamMasker

__all__ = [
    "DEFAULT_MASKER",
    "ENTITY_TYPES",
    "Detector",
    "Finding",
    "MaskResult",
    "MaskingPolicy",
    "PIIMasker",
    "StreamMasker",
    "mask_pii",
]
