"""The arguments of a tool that never sees personal data (``sees_values=False``), masked."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from keel.privacy._masker import maskable_json

__all__ = ["masked_json"]


async def masked_json(value: Any, amask: Callable[[str], Awaitable[str]]) -> Any:
    """``value`` (JSON data: a call's arguments) with each string in it masked by ``amask``:
    a placeholder the model wrote stays as it is, a value it wrote itself is masked. An
    object's keys are texts too (an address as the key of a ``dict[str, str]``). A number is
    masked as the journal reads it, after its key (``"order_id": 4896585277`` is an id, as
    in the journal): one that is a value (a card number written as an integer) becomes its
    placeholder, which a number argument then refuses.

    The texts are masked as one, as the journal reads the call: a masker without a vault
    numbers placeholders per text, and masked one by one two addresses were both
    ``<EMAIL_1>`` (the tool told one value twice, an object with both as keys left with one).
    """
    pieces: list[str] = []
    _collect(value, None, pieces)
    if not pieces:
        return value
    return _rebuilt(value, None, iter(await _masked_together(pieces, amask)))


def _labelled(number: int | float, label: str | None) -> tuple[str, str]:
    written = json.dumps(number)
    before = "" if label is None else f"{json.dumps(label, ensure_ascii=False)}: "
    return before + written, written


def _collect(value: Any, label: str | None, pieces: list[str]) -> None:
    """The texts of ``value`` to mask, in the order `_rebuilt` takes them back."""
    if isinstance(value, str):
        pieces.append(value)
    elif isinstance(value, list):
        for item in value:
            _collect(item, None, pieces)
    elif isinstance(value, dict):
        for key, item in value.items():
            pieces.append(str(key))
            _collect(item, str(key), pieces)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        pieces.append(_labelled(value, label)[0])


def _rebuilt(value: Any, label: str | None, masked: Iterator[str]) -> Any:
    if isinstance(value, str):
        return next(masked)
    if isinstance(value, list):
        return [_rebuilt(item, None, masked) for item in value]
    if isinstance(value, dict):
        rebuilt: dict[str, Any] = {}
        for key, item in value.items():
            name = next(masked)
            rebuilt[name] = _rebuilt(item, str(key), masked)
        return rebuilt
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = next(masked)
        written = _labelled(value, label)[1]
        return value if text.endswith(written) else text.rpartition(": ")[2]
    return value


async def _masked_together(pieces: list[str], amask: Callable[[str], Awaitable[str]]) -> list[str]:
    """``pieces`` masked as one text (a JSON list of them), each back in its place; one by
    one where a finding ran across two of them (the list no longer reads as they were)."""
    masked = await amask(maskable_json(pieces, sort_keys=False))
    try:
        read = json.loads(masked)
    except ValueError:
        read = None
    if (
        isinstance(read, list)
        and len(read) == len(pieces)
        and all(isinstance(piece, str) for piece in read)
    ):
        return read
    return [await amask(piece) for piece in pieces]
