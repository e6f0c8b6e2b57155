from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NotRequired, TypedDict

import pytest
from pydantic import BaseModel, Field
from typing_extensions import TypedDict as ExtTypedDict

from keel.errors import StateDefinitionError, StateMigrationError, StateValidationError
from keel.messages import Message
from keel.state import AgentState, StateSchema, StateStore, add_messages, append
from keel.state.examples import flight_booking_machine
from keel.testing._state_worker import state_backend_at


class GraphState(ExtTypedDict):
    messages: Annotated[list[Message], add_messages]
    visited: Annotated[list[str], append]
    summary: NotRequired[str]


def test_typed_dict_state_validates_and_reduces() -> None:
    schema = StateSchema[GraphState](GraphState)
    state = schema.validate({"messages": [], "visited": []})
    state = schema.apply(state, {"messages": Message.user("hi"), "visited": "a"})
    state = schema.apply(state, {"visited": ["b"], "summary": "s"})
    assert state["visited"] == ["a", "b"] and state["summary"] == "s"
    assert state["messages"][0].content == "hi"
    with pytest.raises(StateValidationError):
        schema.validate({"messages": "nope", "visited": []})
    with pytest.raises(StateValidationError, match="no field"):
        schema.apply(state, {"other": 1})


def test_typed_dict_state_in_a_store_round_trips(tmp_path: Path) -> None:
    store = StateStore(
        state_backend_at(f"sqlite:///{tmp_path / 's.db'}"), StateSchema[GraphState](GraphState)
    )
    cp = store.create("g", {"messages": [], "visited": []})
    cp = store.update("g", {"visited": "x", "messages": [Message.user("q")]}, expected_version=1)
    cp = store.update("g", {"summary": "done"}, expected_version=cp.version)
    fresh = StateStore(
        state_backend_at(f"sqlite:///{tmp_path / 's.db'}"), StateSchema[GraphState](GraphState)
    )
    loaded = fresh.load("g").state
    assert loaded == cp.state and loaded["summary"] == "done"
    assert "summary" not in fresh.at("g", 2).state
    store.close()
    fresh.close()


def test_plain_typing_typed_dict_is_reported_clearly() -> None:
    class Plain(TypedDict):
        x: int

    # Pydantic needs typing_extensions.TypedDict before Python 3.12.
    import sys

    if sys.version_info < (3, 12):
        with pytest.raises(StateDefinitionError, match="typing_extensions"):
            StateSchema(Plain)
    else:
        assert StateSchema(Plain).validate({"x": 1}) == {"x": 1}


def test_not_a_state_type_or_bad_versions() -> None:
    with pytest.raises(StateDefinitionError):
        StateSchema(int)
    with pytest.raises(StateDefinitionError):
        StateSchema(AgentState, version=0)
    with pytest.raises(StateDefinitionError):
        StateSchema(AgentState, version=2, migrations={2: lambda d: d})
    schema = StateSchema(AgentState, version=2)
    with pytest.raises(StateDefinitionError):
        schema.migration(2)


def test_agent_state_validates_at_every_boundary() -> None:
    schema = StateSchema(AgentState)
    state = schema.validate({})
    with pytest.raises(StateValidationError, match="step"):
        schema.apply(state, {"step": -1})
    with pytest.raises(StateValidationError, match="max_steps"):
        schema.validate({"max_steps": 0})
    with pytest.raises(StateValidationError, match="past max_steps"):
        schema.apply(state, {"step": 51})
    with pytest.raises(StateValidationError):
        schema.apply(state, {"machine": {"state": ""}})
    machine = flight_booking_machine()
    state = schema.apply(state, {"machine": machine.start(), "data": {"a": 1}})
    state = schema.apply(state, {"data": {"b": 2}})
    assert state.data == {"a": 1, "b": 2} and state.machine is not None


class V1(BaseModel):
    name: str


class V3(BaseModel):
    full_name: str
    tags: list[str] = Field(default_factory=list)


def test_migrations_chain_and_failures() -> None:
    schema = StateSchema(V3, name="person", version=3)

    @schema.migration(1)
    def rename(data: dict[str, Any]) -> dict[str, Any]:
        return {"full_name": data.pop("name")}

    @schema.migration(2)
    def add_tags(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "tags": ["migrated"]}

    state = schema.load({"name": "Ada"}, stored_name="person", stored_version=1)
    assert state == V3(full_name="Ada", tags=["migrated"])
    assert schema.load({"full_name": "B", "tags": []}, stored_name="person", stored_version=3)
    with pytest.raises(StateMigrationError, match="newer"):
        schema.load({}, stored_name="person", stored_version=4)
    with pytest.raises(StateMigrationError, match="lacks field"):
        schema.load({"full_name": "B"}, stored_name="person", stored_version=3)
    with pytest.raises(StateMigrationError, match="unknown field"):
        schema.load({"full_name": "B", "tags": [], "x": 1}, stored_name="person", stored_version=3)

    @schema.migration(2)
    def broken(data: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("boom")

    with pytest.raises(StateMigrationError, match="failed"):
        schema.load({"name": "Ada"}, stored_name="person", stored_version=1)
    with pytest.raises(StateValidationError):
        StateSchema(V1).load({"name": 5}, stored_name="V1", stored_version=1)


class Notes(BaseModel):
    items: list[str] = Field(default_factory=list)
    rows: list[dict[str, int]] = Field(default_factory=list)
    meta: dict[str, int] = Field(default_factory=dict)


def test_in_place_mutation_of_a_returned_state_is_still_stored(tmp_path: Path) -> None:
    """Deltas reuse unchanged JSON by object identity; mutating in place must not defeat it."""
    store = StateStore(state_backend_at(f"sqlite:///{tmp_path / 'n.db'}"), Notes)
    cp = store.create("n", Notes(items=["a"], rows=[{"x": 1}]))
    cp.state.items.append("b")
    cp.state.rows[0]["x"] = 2
    cp.state.meta["k"] = 1
    version = store.checkpoint("n", cp.state, expected_version=1, reason="update")
    again = store.load("n")
    assert again.state == Notes(items=["a", "b"], rows=[{"x": 2}], meta={"k": 1})
    again.state.items.append("c")
    store.checkpoint("n", again.state, expected_version=version, reason="update")
    fresh = StateStore(state_backend_at(f"sqlite:///{tmp_path / 'n.db'}"), Notes)
    assert fresh.load("n").state.items == ["a", "b", "c"]
    store.close()
    fresh.close()
