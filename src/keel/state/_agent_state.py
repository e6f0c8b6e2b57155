"""A ready-made state model for agents: messages, step counters and a workflow position."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from keel.messages import Message
from keel.state._machine import MachinePosition
from keel.state._reducers import add_messages, merge

__all__ = ["AgentState"]


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

    @model_validator(mode="after")
    def _within_limit(self) -> AgentState:
        if self.step > self.max_steps:
            raise ValueError(f"step {self.step} is past max_steps {self.max_steps}")
        return self
