"""Two checkpoints' states compared field by field, as the session page shows them: each
changed leaf (``machine.slots.origin``, ``messages[12].content``) with its value before and
after, long text diffed by words. A string holding JSON (a summary kept as JSON text) is
compared inside, not as one escaped string."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FieldChange", "Words", "field_diff", "parsed_json"]

_LONG = 60
"""Strings longer than this (either side) are diffed by words rather than shown whole twice."""

_MISSING = object()


@dataclass(frozen=True)
class Words:
    """One run of words of a text diff: kept, inserted or deleted."""

    op: Literal["same", "add", "del"]
    text: str


@dataclass(frozen=True)
class FieldChange:
    """One field that differs between the two states."""

    path: str
    change: Literal["added", "removed", "changed"]
    before: str
    after: str
    words: tuple[Words, ...] = ()
    """The word diff of a long text (empty otherwise)."""


def _shown(value: Any) -> str:
    if value is _MISSING:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(parsed_json(value), ensure_ascii=False, sort_keys=True)


def parsed_json(value: Any) -> Any:
    """``value`` with every string that holds JSON parsed (a tool call's arguments)."""
    value = _as_json(value)
    if isinstance(value, dict):
        return {key: parsed_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [parsed_json(item) for item in value]
    return value


def _as_json(value: Any) -> Any:
    """A string that holds a JSON object or array, parsed; anything else as it is."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _words(before: str, after: str) -> tuple[Words, ...]:
    old, new = re.findall(r"\s+|\S+", before), re.findall(r"\s+|\S+", after)
    runs: list[Words] = []
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            runs.append(Words("same", "".join(old[i1:i2])))
            continue
        if i2 > i1:
            runs.append(Words("del", "".join(old[i1:i2])))
        if j2 > j1:
            runs.append(Words("add", "".join(new[j1:j2])))
    return tuple(runs)


def _walk(path: str, before: Any, after: Any, out: list[FieldChange]) -> None:
    before, after = _as_json(before), _as_json(after)
    if before == after:
        return
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after), key=str):
            child = f"{path}.{key}" if path else str(key)
            _walk(child, before.get(key, _MISSING), after.get(key, _MISSING), out)
        return
    if isinstance(before, list) and isinstance(after, list):
        for index in range(max(len(before), len(after))):
            old = before[index] if index < len(before) else _MISSING
            new = after[index] if index < len(after) else _MISSING
            _walk(f"{path}[{index}]", old, new, out)
        return
    change: Literal["added", "removed", "changed"] = (
        "added" if before is _MISSING else "removed" if after is _MISSING else "changed"
    )
    old, new = _shown(before), _shown(after)
    words: tuple[Words, ...] = ()
    texts = isinstance(before, str) and isinstance(after, str)
    if change == "changed" and texts and max(len(old), len(new)) > _LONG:
        words = _words(old, new)
    out.append(FieldChange(path or "(state)", change, old, new, words))


def field_diff(older: Any, newer: Any) -> list[FieldChange]:
    """Every leaf of ``older`` and ``newer`` (JSON data) that differs, in path order."""
    changes: list[FieldChange] = []
    _walk("", older, newer, changes)
    return changes
