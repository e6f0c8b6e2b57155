"""Reducers: how an update to one field of the state combines with the value already there.

A field declares its reducer in its annotation, ``Annotated[list[Message], add_messages]``; a
field without one is overwritten. Every update goes through the reducers, so two parts of an
agent that both "add a message" never overwrite each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel

from keel.messages import Message

__all__ = [
    "Reducer",
    "ReducerKind",
    "add",
    "add_messages",
    "append",
    "find_reducer",
    "merge",
    "overwrite",
    "reducer",
]

ReducerKind = Literal["overwrite", "append", "merge", "add", "messages", "custom"]
"""What a reducer does, so storage and tools can reason about it."""


class Reducer:
    """A named function ``(current, update) -> new`` used to combine a field update.

    Instances are placed in ``typing.Annotated`` metadata. Plain functions are accepted there too
    and are wrapped as ``custom`` reducers.
    """

    __slots__ = ("fn", "kind", "name")

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        name: str | None = None,
        kind: ReducerKind = "custom",
    ) -> None:
        self.fn = fn
        self.kind: ReducerKind = kind
        self.name = name or getattr(fn, "__name__", "reducer")

    def __call__(self, current: Any, update: Any) -> Any:
        return self.fn(current, update)

    def __repr__(self) -> str:
        return f"Reducer({self.name!r}, kind={self.kind!r})"


def reducer(fn: Callable[[Any, Any], Any]) -> Reducer:
    """Declare a custom reducer: ``Annotated[int, reducer(max)]`` keeps the larger value."""
    return Reducer(fn, kind="custom")


def _overwrite(current: Any, update: Any) -> Any:
    return update


def _items(update: Any) -> list[Any]:
    if isinstance(update, (list, tuple)):
        return list(update)
    # Pydantic models are iterable (over their fields) but are single items here.
    if isinstance(update, (str, bytes, Mapping, BaseModel)) or not isinstance(update, Iterable):
        return [update]
    return list(update)


def _append(current: Any, update: Any) -> Any:
    return [*(current or ()), *_items(update)]


def _merge(current: Any, update: Any) -> Any:
    if not isinstance(update, Mapping):
        raise TypeError(f"merge expects a mapping update, got {type(update).__name__}")
    return {**(current or {}), **update}


def _add(current: Any, update: Any) -> Any:
    return (current or 0) + update


def _message_id(message: Message) -> str | None:
    value = message.metadata.get("id")
    return str(value) if value is not None else None


def _add_messages(current: Any, update: Any) -> Any:
    """Append messages; a message whose ``metadata["id"]`` matches an existing one replaces it.

    Replacement keeps the original position, so an edited message stays where it was; messages
    without an id are always appended. This is the only way to change an earlier message through
    a reducer, and it is explicit (same id), never by content.
    """
    result: list[Message] = list(current or ())
    incoming = [
        item if isinstance(item, Message) else Message.model_validate(item)
        for item in _items(update)
    ]
    positions: dict[str, int] = {}
    # Index the existing ids only when an incoming message carries one (the common case,
    # plain appends, stays O(update)).
    if any(_message_id(message) is not None for message in incoming):
        for index, message in enumerate(result):
            key = _message_id(message)
            if key is not None:
                positions[key] = index
    for message in incoming:
        key = _message_id(message)
        if key is not None and key in positions:
            result[positions[key]] = message
        else:
            if key is not None:
                positions[key] = len(result)
            result.append(message)
    return result


overwrite = Reducer(_overwrite, name="overwrite", kind="overwrite")
"""The default: the update replaces the value."""

append = Reducer(_append, name="append", kind="append")
"""Append an item, or every item of a list/tuple, to a list field."""

merge = Reducer(_merge, name="merge", kind="merge")
"""Shallow-merge a mapping update into a dict field (update's keys win)."""

add = Reducer(_add, name="add", kind="add")
"""Add a number to a numeric field (a counter)."""

add_messages = Reducer(_add_messages, name="add_messages", kind="messages")
"""Append messages to a ``list[Message]``; same ``metadata["id"]`` replaces in place."""


def find_reducer(metadata: Iterable[Any]) -> Reducer | None:
    """The reducer among ``Annotated`` metadata (a ``Reducer`` or a plain function), if any."""
    found: Reducer | None = None
    for item in metadata:
        candidate: Reducer | None = None
        if isinstance(item, Reducer):
            candidate = item
        elif inspect.isfunction(item) or inspect.isbuiltin(item):
            candidate = Reducer(item, kind="custom")
        if candidate is not None:
            if found is not None:
                raise TypeError("a field may declare only one reducer")
            found = candidate
    return found
