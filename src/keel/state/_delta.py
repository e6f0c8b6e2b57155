"""Delta encoding of checkpoints: store what changed, not the whole state at every step.

A checkpoint is either a full snapshot (``{"full": {field: value}}``) or a delta against the
version before it: ``{"set": {field: value}, "extend": {field: [appended items]}, "unset": [...]}``.
A list field whose new value starts with the old one (messages, event logs) is stored as the
appended tail only, so a session whose message list grows by one message per step stores each
message once between snapshots.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["apply_delta", "decode", "diff", "encode_full"]


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


def apply_delta(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``delta`` applied (``base`` is not changed)."""
    result = dict(base)
    for name, value in delta.get("set", {}).items():
        result[name] = value
    for name, tail in delta.get("extend", {}).items():
        result[name] = [*result.get(name, ()), *tail]
    for name in delta.get("unset", ()):
        result.pop(name, None)
    return result


def encode_full(state: dict[str, Any]) -> str:
    """A full snapshot payload."""
    return json.dumps({"full": state}, separators=(",", ":"), ensure_ascii=False)


def decode(payload: str, base: dict[str, Any] | None) -> dict[str, Any]:
    """The state a payload describes, given the state of the version before it."""
    document = json.loads(payload)
    if "full" in document:
        return dict(document["full"])
    if base is None:
        raise ValueError("a delta checkpoint needs the state before it")
    return apply_delta(base, document)
