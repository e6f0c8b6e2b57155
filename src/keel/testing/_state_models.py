"""State types the state conformance suite and its crash-test worker share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from keel.messages import Message
from keel.state import add, add_messages, append

__all__ = ["ConversationState", "CounterState", "OrderState"]


class CounterState(BaseModel):
    """A counter and a list many writers add to at once."""

    model_config = ConfigDict(extra="forbid")

    counter: Annotated[int, add] = Field(default=0, ge=0, description="Sum of increments.")
    items: Annotated[list[str], append] = Field(default_factory=list, description="Items added.")
    note: str = Field(default="", description="Overwritten on each update.")


class ConversationState(BaseModel):
    """A conversation that grows by one exchange per step."""

    model_config = ConfigDict(extra="forbid")

    messages: Annotated[list[Message], add_messages] = Field(
        default_factory=list, description="The conversation."
    )
    step: int = Field(default=0, ge=0, description="Exchanges completed.")


class OrderState(BaseModel):
    """The e-commerce seed: one order an agent may cancel or re-address."""

    model_config = ConfigDict(extra="forbid")

    order_id: int = Field(description="The order number.")
    status: str = Field(default="placed", description="placed, cancelled or shipped.")
    shipping_address: str = Field(description="Where the order ships.")
    log: Annotated[list[str], append] = Field(
        default_factory=list, description="What the agents did."
    )
