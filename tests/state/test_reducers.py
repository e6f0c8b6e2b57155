from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel

from keel.errors import StateDefinitionError, StateValidationError
from keel.messages import Message
from keel.state import (
    StateSchema,
    add,
    add_messages,
    append,
    merge,
    overwrite,
    reducer,
)


def test_builtin_reducers() -> None:
    assert overwrite(1, 2) == 2
    assert append(None, "a") == ["a"]
    assert append(["a"], ["b", "c"]) == ["a", "b", "c"]
    assert append(["a"], ("b",)) == ["a", "b"]
    assert append([], {"k": 1}) == [{"k": 1}]
    assert merge({"a": 1, "b": 1}, {"b": 2, "c": 3}) == {"a": 1, "b": 2, "c": 3}
    assert add(2, 3) == 5 and add(None, 1) == 1
    with pytest.raises(TypeError):
        merge({}, ["not", "a", "mapping"])


def test_add_messages_appends_and_replaces_by_metadata_id_in_place() -> None:
    first = Message.user("hi", metadata={"id": "u1"})
    draft = Message.assistant("draft", metadata={"id": "a1"})
    messages = add_messages([], [first, draft])
    messages = add_messages(messages, Message.user("no id"))
    messages = add_messages(messages, Message.assistant("final", metadata={"id": "a1"}))
    assert [m.content for m in messages] == ["hi", "final", "no id"]
    messages = add_messages(messages, {"role": "user", "content": "from dict"})
    assert messages[-1] == Message.user("from dict")
    # Two messages without ids and with equal content are both kept: replacement is by id only.
    assert len(add_messages([Message.user("x")], [Message.user("x")])) == 2


def test_reducers_are_declared_on_fields_and_every_update_uses_them() -> None:
    class State(BaseModel):
        messages: Annotated[list[Message], add_messages] = []
        tags: Annotated[list[str], append] = []
        meta: Annotated[dict[str, int], merge] = {}
        best: Annotated[int, reducer(max)] = 0
        total: Annotated[int, lambda a, b: a + 2 * b] = 0
        name: str = ""

    schema = StateSchema(State)
    assert schema.reducer_of("messages") is add_messages
    assert schema.reducer_of("name") is overwrite
    state = schema.apply(
        State(),
        {
            "messages": [Message.user("a")],
            "tags": "t1",
            "meta": {"x": 1},
            "best": 5,
            "total": 3,
            "name": "n",
        },
    )
    state = schema.apply(
        state, {"tags": ["t2"], "meta": {"y": 2}, "best": 2, "total": 1, "name": "m"}
    )
    assert state.tags == ["t1", "t2"] and state.meta == {"x": 1, "y": 2}
    assert state.best == 5 and state.total == 8 and state.name == "m"
    with pytest.raises(StateValidationError, match="reducer merge"):
        schema.apply(state, {"meta": [1]})


def test_two_reducers_on_one_field_is_a_definition_error() -> None:
    class Bad(BaseModel):
        items: Annotated[list[int], append, merge] = []

    with pytest.raises(StateDefinitionError, match="only one reducer"):
        StateSchema(Bad)
