"""The digest that binds a decision to the exact arguments it approved.

Every channel that decides (``Agent.decide``, the user's words in the conversation, HTTP, the
CLI, the viewer) records [`arguments_digest`][] of the masked arguments it showed and approved
(the corrected ones when it gave any); the agent computes it again over the arguments it is
about to run, and runs nothing when the two differ. The arguments are compared as JSON values,
not as text: key order and spacing do not make two calls differ, a changed value does.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["arguments_digest", "canonical_arguments"]


def canonical_arguments(text: str) -> str:
    """``text`` (a call's masked JSON arguments) in one canonical form: keys sorted, no
    spacing; text that is not JSON is taken as it is."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def arguments_digest(text: str) -> str:
    """SHA-256 (hex) of ``text``'s canonical form ([`canonical_arguments`][]): what a
    decision records in ``ApprovalDecision.arguments_digest``."""
    return hashlib.sha256(canonical_arguments(text).encode("utf-8")).hexdigest()
