"""Memory records: what keel keeps across sessions, with scope, provenance and time."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.privacy import PIIMasker

__all__ = [
    "RUN_TYPE",
    "MemoryFilter",
    "MemoryKind",
    "MemoryRecord",
    "Provenance",
    "Scope",
    "ShownSession",
    "content_hash",
    "mask_text",
    "utcnow",
]

MemoryKind = Literal["episodic", "semantic", "procedural"]
"""Episodic: what happened. Semantic: facts and preferences. Procedural: how to do things."""

Provenance = Literal["user_claim", "verified", "inferred"]
"""Who vouches for a record: the user said it, a tool/system verified it, or a model inferred it."""

RUN_TYPE = "run"
"""The type of a successful run kept for experience replay (never a search hit otherwise)."""


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class Scope(BaseModel):
    """Whose memory: every read and write is confined to one tenant and one user."""

    model_config = ConfigDict(frozen=True)

    tenant_id: str = Field(
        min_length=1, description="The tenant (organisation, app) owning the data."
    )
    user_id: str = Field(min_length=1, description="The end user within the tenant.")


def content_hash(
    kind: str,
    type_: str,
    text: str,
    subject: str | None,
    attribute: str | None,
    key: str | None = None,
) -> str:
    """Identity of a memory's content within a scope (adding it twice is a no-op).

    A keyed record's key is part of it: two keys may hold the same text.
    """
    normalized = " ".join(text.split())
    parts = (kind, type_, subject or "", attribute or "", normalized)
    material = "\x1f".join(parts if key is None else (*parts, key))
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


class MemoryRecord(BaseModel):
    """One long-term memory. ``text`` is always stored masked (PII and secrets replaced)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Stable identifier (32 hex characters).")
    tenant_id: str = Field(description="Tenant scope.")
    user_id: str = Field(description="User scope.")
    kind: MemoryKind = Field(description="episodic, semantic or procedural.")
    type: str = Field(
        default="note",
        description="Finer label within the kind: turn, summary, run, fact, workflow...",
    )
    text: str = Field(description="The content, PII-masked before it was persisted.")
    provenance: Provenance = Field(description="user_claim, verified or inferred.")
    verified_by: str | None = Field(
        default=None, description="The tool or system that verified a 'verified' record."
    )
    session_id: str | None = Field(default=None, description="Session the record came from.")
    step: int | None = Field(default=None, description="Agent step within the session.")
    turn: int | None = Field(
        default=None, description="Turn number within the session (orders neighbouring turns)."
    )
    created_at: datetime = Field(description="When keel stored it (UTC).")
    event_time: datetime | None = Field(
        default=None, description="When the remembered event happened, if known."
    )
    subject: str | None = Field(default=None, description="Semantic fact: who or what it is about.")
    attribute: str | None = Field(default=None, description="Semantic fact: which property.")
    valid_from: datetime | None = Field(
        default=None, description="Semantic fact: when this value became current."
    )
    valid_to: datetime | None = Field(
        default=None, description="Semantic fact: when a newer value superseded it (None: current)."
    )
    content_hash: str = Field(description="Hash of the content; unique per scope.")
    embedding_model: str | None = Field(
        default=None, description="Model that produced the stored vector (None: not embedded yet)."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form JSON metadata.")
    key: str | None = Field(
        default=None,
        description="The caller's name for the record, unique within the scope: a record added "
        "under a key replaces the one that had it (stored as given, never masked).",
    )
    expires_at: datetime | None = Field(
        default=None,
        description="When the record expires: reads leave it out from then on and "
        "``purge_expired`` deletes it (None: never).",
    )

    @property
    def scope(self) -> Scope:
        """The record's scope."""
        return Scope(tenant_id=self.tenant_id, user_id=self.user_id)

    @property
    def is_current(self) -> bool:
        """False once a newer value for the same subject and attribute superseded it."""
        return self.valid_to is None

    @property
    def when(self) -> datetime:
        """The event time when known, else the creation time."""
        return self.event_time or self.created_at


def is_fact(record: MemoryRecord) -> bool:
    """Whether a record is a value of a fact (a semantic record with subject and attribute):
    one of a chain of validity intervals, the newest current."""
    return record.kind == "semantic" and bool(record.subject) and bool(record.attribute)


def same_content(stored: MemoryRecord, record: MemoryRecord) -> bool:
    """Whether a stored record holds ``record``'s content (compared on what the content hash
    is made of: a fact's reopened value has a hash of its own)."""
    made = content_hash(
        stored.kind, stored.type, stored.text, stored.subject, stored.attribute, stored.key
    )
    return made == record.content_hash


def reopened(record: MemoryRecord) -> MemoryRecord:
    """``record``, a fact's value that held before and holds again, as a record of its own:
    its hash is made unique (the record's id in it), so the earlier interval's record, whose
    hash it shares, stays as it was."""
    unique = hashlib.sha256(f"{record.content_hash}\x1f{record.id}".encode()).hexdigest()
    return record.model_copy(update={"content_hash": unique})


class ShownSession(BaseModel):
    """What a prompt already shows of one session, for a search to leave out: its turns from
    ``first_turn`` on (verbatim in the prompt's window) and its running summary (the record
    under ``summary_key``). The session's earlier turns, its other records and every other
    session's records stay searchable. A search with it leaves these records out of its
    candidates, and out of the neighbouring turns it shows with a hit, so its ``k`` hits are
    all records the prompt does not show.
    """

    model_config = ConfigDict(frozen=True)

    session_id: str = Field(description="The session the prompt shows.")
    first_turn: int | None = Field(
        default=None,
        description="The session's first turn in the prompt's window: records of this turn "
        "and later ones are left out (None: no turn is).",
    )
    summary_key: str | None = Field(
        default=None, description="The key of the session's summary record, left out too."
    )

    def clip(self, session_id: str, first: int, last: int) -> tuple[str, int, int] | None:
        """The part of a span of ``session_id``'s turns (``first`` to ``last``, both
        included) the prompt does not show; None when it shows all of it."""
        if session_id != self.session_id or self.first_turn is None:
            return session_id, first, last
        last = min(last, self.first_turn - 1)
        return (session_id, first, last) if first <= last else None


class MemoryFilter(BaseModel):
    """Optional narrowing of a search or listing; the scope is always applied on top."""

    model_config = ConfigDict(frozen=True)

    kinds: tuple[MemoryKind, ...] = Field(
        default=(), description="Only these kinds (all if empty)."
    )
    types: tuple[str, ...] = Field(default=(), description="Only these types (all if empty).")
    exclude_types: tuple[str, ...] = Field(default=(), description="Never these types.")
    session_id: str | None = Field(default=None, description="Only this session.")
    include_superseded: bool = Field(
        default=False, description="Also return facts a newer value superseded."
    )
    since: datetime | None = Field(default=None, description="Only records created at or after.")
    until: datetime | None = Field(default=None, description="Only records created before.")
    keys: tuple[str, ...] = Field(default=(), description="Only records with one of these keys.")
    key_prefix: str | None = Field(
        default=None,
        description="Only records whose key starts with this text, compared character by "
        "character (no character is a wildcard).",
    )
    shown: ShownSession | None = Field(
        default=None,
        description="What the asking prompt already shows of its own session, left out.",
    )
    include_expired: bool = Field(default=False, description="Also return expired records.")
    alive_at: datetime | None = Field(
        default=None,
        description="The time expiry is judged at (None: now); records expired by then are "
        "left out unless ``include_expired``.",
    )


def mask_text(masker: PIIMasker | None, text: str, tenant_id: str) -> str:
    """``text`` with its PII masked for ``tenant_id`` (as it is when masking is off)."""
    return text if masker is None else masker.mask_text(text, tenant_id=tenant_id)
