"""A ready-made state model for agents: messages, step counters and a workflow position."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keel.messages import Message
from keel.state._machine import MachinePosition
from keel.state._reducers import add_messages, merge

__all__ = ["AgentState", "SessionRuntime"]


class SessionRuntime(BaseModel):
    """keel's own bookkeeping for one session, typed and kept apart from the application's
    ``data``: who owns the session, the turn in flight, and the running summary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant_id: str | None = Field(
        default=None, description="The tenant the session belongs to (set on its first turn)."
    )
    user_id: str | None = Field(
        default=None, description="The user the session belongs to (set on its first turn)."
    )
    turns: int = Field(default=0, ge=0, description="User messages handled so far.")
    open_turn: str | None = Field(
        default=None,
        description="The id of the turn in flight: set when a turn starts, cleared when it "
        "commits. Found set after a crash, the turn is resumed before anything else.",
    )
    open_turn_message: int | None = Field(
        default=None, ge=0, description="Index in ``messages`` of the open turn's user message."
    )
    summary: str = Field(default="", description="The running summary of evicted turns.")
    messages_summarized: int = Field(
        default=0, ge=0, description="Leading messages folded into the summary."
    )
    turns_summarized: int = Field(default=0, ge=0, description="Turns folded into the summary.")
    finished_workflows: tuple[dict[str, Any], ...] = Field(
        default=(), description="The last positions of finished workflow instances (newest 20)."
    )
    awaiting: tuple[str, ...] = Field(
        default=(),
        description="The approval requests the session's last turn is parked on (their ids): "
        "once all are decided, the turn goes on from where it stopped.",
    )
    replies: tuple[dict[str, Any], ...] = Field(
        default=(),
        description="The replies of the newest turns a caller gave its own turn id "
        "(``{'turn_id', 'request', 'reply'}``, newest 16), committed with each turn: a retry "
        "of such a turn gets its reply back instead of running again.",
    )


class AgentState(BaseModel):
    """The state most agents need; subclass it to add fields (each may declare a reducer)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    messages: Annotated[list[Message], add_messages] = Field(
        default_factory=list,
        description="The conversation; updates append (same metadata id replaces).",
    )
    step: int = Field(default=0, ge=0, description="Steps (model calls) taken so far.")
    max_steps: int = Field(default=50, gt=0, description="The run's step limit.")
    machine: MachinePosition | None = Field(
        default=None, description="Position in the workflow's state machine, if it has one."
    )
    data: Annotated[dict[str, Any], merge] = Field(
        default_factory=dict, description="Application data; updates merge key by key."
    )
    runtime: SessionRuntime = Field(
        default_factory=SessionRuntime,
        description="keel's bookkeeping (owner, open turn, summary); not for applications.",
    )

    # StateSchema validates appended messages alone for models whose only model validators are
    # AgentState's (_schema._extensible_lists): a validator here must not read ``messages``.
    @model_validator(mode="after")
    def _within_limit(self) -> AgentState:
        if self.step > self.max_steps:
            raise ValueError(f"step {self.step} is past max_steps {self.max_steps}")
        return self
