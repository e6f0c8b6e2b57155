"""Delta encoding of checkpoints: store what changed, not the whole state at every step.

A checkpoint is either a full snapshot (``{"full": {field: value}}``) or a delta against the
version before it: ``{"set": {field: value}, "extend": {field: [appended items]}, "unset": [...]}``.
A list field whose new value starts with the old one (messages, event logs) is stored as the
appended tail only, so a session whose message list grows by one message per step stores each
message once between snapshots.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["diff", "encode_full", "replay"]


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The delta that turns JSON state ``old`` into ``new``."""
    sets: dict[str, Any] = {}
    extends: dict[str, list[Any]] = {}
    for name, value in new.items():
        if name not in old:
            sets[name] = value
            continue
        previous = old[name]
        if previous is value:
            continue
        if (
            isinstance(value, list)
            and isinstance(previous, list)
            and len(value) >= len(previous)
            and value[: len(previous)] == previous
        ):
            if len(value) > len(previous):
                extends[name] = value[len(previous) :]
            continue
        if previous != value:
            sets[name] = value
    delta: dict[str, Any] = {}
    if sets:
        delta["set"] = sets
    if extends:
        delta["extend"] = extends
    unset = sorted(set(old) - set(new))
    if unset:
        delta["unset"] = unset
    return delta


def encode_full(state: dict[str, Any]) -> str:
    """A full snapshot payload."""
    return json.dumps({"full": state}, separators=(",", ":"), ensure_ascii=False)


def replay(payloads: Iterable[str]) -> dict[str, Any]:
    """The state a chain describes: a full snapshot's payload, then the deltas after it in order.

    The state being built is this function's own (every value comes from parsing a payload), so
    each delta is applied in place: replaying k deltas costs their size, not k copies of the
    state's lists.

    Raises:
        ValueError: the chain is empty or does not start with a full snapshot.
    """
    state: dict[str, Any] | None = None
    for payload in payloads:
        document = json.loads(payload)
        if "full" in document:
            state = dict(document["full"])
            continue
        if state is None:
            raise ValueError("a delta checkpoint needs the state before it")
        state.update(document.get("set", {}))
        for name, tail in document.get("extend", {}).items():
            state.setdefault(name, []).extend(tail)
        for name in document.get("unset", ()):
            state.pop(name, None)
    if state is None:
        raise ValueError("an empty chain describes no state")
    return state
