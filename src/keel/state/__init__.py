"""Durable workflow state: typed state with reducers, state machines, versioned checkpoints.

```python
from typing import Annotated
from pydantic import BaseModel
from keel.messages import Message
from keel.settings import load_settings
from keel.state import StateStore, add_messages
from keel.stores import Backends

class Chat(BaseModel):
    messages: Annotated[list[Message], add_messages] = []
    step: int = 0

# The state store alone: its backend owns the database, and closing the store closes it.
opened = Backends.open("sqlite:///keel.db", settings=load_settings(), only=("state",))
store = StateStore(opened.state.backend, Chat)
cp = store.create("s1", Chat())
cp = store.update("s1", {"messages": [Message.user("hi")]}, expected_version=cp.version)
```

Every write is compare-and-set on the version it read (``ConflictError`` otherwise); history is
kept as deltas with periodic snapshots; schema versions migrate or fail loudly.
"""

from __future__ import annotations

from keel.state._agent_state import AgentState, SessionRuntime
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.state._checkpoint import (
    Checkpoint,
    CheckpointInfo,
    CheckpointReason,
    Retention,
    VacuumReport,
)
from keel.state._erasure import StateErasure, erase_user_sessions
from keel.state._lease import SessionLock
from keel.state._machine import (
    Guard,
    MachinePosition,
    MachineState,
    StateMachine,
    Transition,
)
from keel.state._reducers import (
    Reducer,
    ReducerKind,
    add,
    add_messages,
    append,
    merge,
    overwrite,
    reducer,
)
from keel.state._retention import vacuum
from keel.state._schema import JSONState, StateMigration, StateSchema
from keel.state._store import StateStore

__all__ = [
    "AgentState",
    "Chain",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointReason",
    "Guard",
    "JSONState",
    "MachinePosition",
    "MachineState",
    "Reducer",
    "ReducerKind",
    "Retention",
    "SessionHead",
    "SessionLock",
    "SessionRuntime",
    "StateBackend",
    "StateErasure",
    "StateMachine",
    "StateMigration",
    "StateSchema",
    "StateStore",
    "StoredCheckpoint",
    "Transition",
    "VacuumReport",
    "add",
    "add_messages",
    "append",
    "erase_user_sessions",
    "merge",
    "overwrite",
    "reducer",
    "vacuum",
]
