"""Delta encoding of checkpoints: store what changed, not the whole state at every step.

A checkpoint is either a full snapshot (``{"full": {field: value}}``) or a delta against the
version before it: ``{"set": {field: value}, "extend": {field: [appended items]}, "patch":
{field: {"set": {key: value}, "unset": [keys]}}, "unset": [fields]}``.
A list field whose new value starts with the old one (messages, event logs) is stored as the
appended tail only, so a session whose message list grows by one message per step stores each
message once between snapshots. An object field (a nested model, a dict) is stored as the keys
that changed, so a large value inside it (a running summary next to counters that change every
step) is stored when it changes, not with every step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic_core import to_json

__all__ = [
    "delta_of",
    "diff",
    "encode_full",
    "encode_full_joined",
    "patch_of",
    "replay",
]


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The delta that turns JSON state ``old`` into ``new``."""
    sets: dict[str, Any] = {}
    extends: dict[str, list[Any]] = {}
    patches: dict[str, dict[str, Any]] = {}
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
        if isinstance(value, dict) and isinstance(previous, dict):
            patch = patch_of(previous, value)
            if patch:
                patches[name] = patch
            continue
        if previous != value:
            sets[name] = value
    return delta_of(sets, extends, patches, sorted(set(old) - set(new)))


def delta_of(
    sets: dict[str, Any],
    extends: dict[str, Any],
    patches: dict[str, Any],
    unset: list[str] | None = None,
) -> dict[str, Any]:
    """The delta document of those changes, each part present only when it holds any."""
    delta: dict[str, Any] = {}
    if sets:
        delta["set"] = sets
    if extends:
        delta["extend"] = extends
    if patches:
        delta["patch"] = patches
    if unset:
        delta["unset"] = unset
    return delta


def patch_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The keys of object ``new`` that differ from ``old`` (one level deep); empty if none."""
    changed = {key: value for key, value in new.items() if key not in old or old[key] != value}
    removed = [key for key in old if key not in new]
    patch: dict[str, Any] = {}
    if changed:
        patch["set"] = changed
    if removed:
        patch["unset"] = removed
    return patch


_json_text = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def encode_json(value: Any) -> str:
    """A payload's JSON, compact and unescaped (``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)`` writes the same JSON value), by pydantic-core: three times faster
    than ``json`` on a checkpoint's delta (its per-call set-up), three of them a turn. A value
    pydantic-core will not write, ``json`` writes (or refuses) as before."""
    try:
        return to_json(value, inf_nan_mode="constants").decode()
    except Exception:
        return _json_text(value)


def encode_full(state: dict[str, Any]) -> str:
    """A full snapshot payload."""
    return encode_json({"full": state})


def _joined(runs: list[str]) -> str:
    return "[" + ",".join(run for run in runs if run) + "]"


def encode_full_joined(state: dict[str, Any], list_texts: dict[str, list[str]]) -> str:
    """``encode_full(state)``, the lists of ``list_texts`` joined from the text they were
    encoded to before instead of encoded again: the same text, at the cost of the fields not
    given. ``list_texts`` maps a list field to its items' text in runs, each the inside of a
    JSON array (``encode_json(items)[1:-1]``), in order: a snapshot of a long history copies
    the texts of the messages its last snapshot wrote, where encoding them again cost about a
    hundred times more."""
    parts = [
        f"{encode_json(name)}:"
        + (_joined(list_texts[name]) if name in list_texts else encode_json(value))
        for name, value in state.items()
    ]
    return '{"full":{' + ",".join(parts) + "}}"


def replay(payloads: Iterable[str], state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state a chain describes: a full snapshot's payload, then the deltas after it in order
    (or, given ``state``, the deltas after that state: a reader catching up on a known version).

    The state being built is this function's own (every value comes from parsing a payload, or
    ``state``, whose fields' lists and objects must be the caller's own copies), so each delta
    is applied in place: replaying k deltas costs their size, not k copies of the state's lists.

    Raises:
        ValueError: the chain is empty or does not start with a full snapshot.
    """
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
        for name, patch in document.get("patch", {}).items():
            target = state.setdefault(name, {})
            target.update(patch.get("set", {}))
            for key in patch.get("unset", ()):
                target.pop(key, None)
        for name in document.get("unset", ()):
            state.pop(name, None)
    if state is None:
        raise ValueError("an empty chain describes no state")
    return state
