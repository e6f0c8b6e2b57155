"""What a checkpoint is to its readers: metadata, the typed state, retention and vacuum results."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Checkpoint", "CheckpointInfo", "CheckpointReason", "Retention", "VacuumReport"]

S = TypeVar("S")


class CheckpointReason:
    """Conventional ``reason`` values (any non-empty string is accepted)."""

    CREATED = "created"
    BEFORE_MODEL_CALL = "before_model_call"
    AFTER_TRANSITION = "after_transition"
    UPDATE = "update"
    REVERT = "revert"
    FORK = "fork"


class CheckpointInfo(BaseModel):
    """One checkpoint in a session's history (without the state itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str = Field(description="The session the checkpoint belongs to.")
    version: int = Field(ge=1, description="The state version this checkpoint committed.")
    created_at: datetime = Field(description="When it was committed (UTC).")
    step: int = Field(ge=0, description="The agent step it was taken at.")
    reason: str = Field(min_length=1, description="Why it was taken (before_model_call, ...).")
    kind: Literal["full", "delta"] = Field(
        description="Stored as a full snapshot or as a delta against the version before it."
    )
    size_bytes: int = Field(ge=0, description="Bytes of its stored payload.")
    schema_version: int = Field(ge=1, description="Schema version of the state it stores.")
    good: bool | None = Field(
        default=None, description="Marked good (revert target) or bad; None when unmarked."
    )
    forked_from: str | None = Field(
        default=None, description="'session@version' this session was forked from, if any."
    )


@dataclass(frozen=True)
class Checkpoint(Generic[S]):
    """A committed version of a session's state: its metadata and the typed state."""

    info: CheckpointInfo
    state: S

    @property
    def session_id(self) -> str:
        """The session."""
        return self.info.session_id

    @property
    def version(self) -> int:
        """The version to pass as ``expected_version`` on the next write."""
        return self.info.version

    @property
    def step(self) -> int:
        """The step it was taken at."""
        return self.info.step


class Retention(BaseModel):
    """How much history ``vacuum()`` keeps per session.

    The head and the latest checkpoint marked good are always kept, so revert still works.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_last: int | None = Field(
        default=None, ge=1, description="Keep at most this many most recent checkpoints."
    )
    max_age_s: float | None = Field(
        default=None, gt=0, description="Drop checkpoints older than this many seconds."
    )


class VacuumReport(BaseModel):
    """What one ``vacuum()`` removed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    expired_sessions: list[str] = Field(
        default_factory=list, description="Sessions deleted because their TTL passed."
    )
    checkpoints_deleted: int = Field(
        default=0, ge=0, description="Old checkpoints removed by the retention policy."
    )
    checkpoints_rebased: int = Field(
        default=0, ge=0, description="Delta checkpoints rewritten as full snapshots."
    )
