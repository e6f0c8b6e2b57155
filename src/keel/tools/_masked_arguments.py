"""The arguments of a tool that never sees personal data (``sees_values=False``), masked."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["masked_json"]


async def masked_json(
    value: Any, amask: Callable[[str], Awaitable[str]], *, label: str | None = None
) -> Any:
    """``value`` (JSON data: a call's arguments) with each string in it masked by ``amask``:
    a placeholder the model wrote stays as it is, a value it wrote itself is masked. An
    object's keys are texts too (an address as the key of a ``dict[str, str]``). A number is
    masked as the journal reads it, after its key (``"order_id": 4896585277`` is an id, as
    in the journal): one that is a value (a card number written as an integer) becomes its
    placeholder, which a number argument then refuses."""
    if isinstance(value, str):
        return await amask(value)
    if isinstance(value, list):
        return [await masked_json(item, amask) for item in value]
    if isinstance(value, dict):
        return {
            await amask(str(key)): await masked_json(item, amask, label=str(key))
            for key, item in value.items()
        }
    if isinstance(value, int | float) and not isinstance(value, bool):
        written = json.dumps(value)
        before = "" if label is None else f"{json.dumps(label, ensure_ascii=False)}: "
        masked = await amask(before + written)
        return value if masked.endswith(written) else masked.rpartition(": ")[2]
    return value
