"""The arguments of a tool that never sees personal data (``sees_values=False``), masked."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["masked_json"]


async def masked_json(value: Any, amask: Callable[[str], Awaitable[str]]) -> Any:
    """``value`` (JSON data: a call's arguments) with each string in it masked by ``amask``:
    a placeholder the model wrote stays as it is, a value it wrote itself is masked."""
    if isinstance(value, str):
        return await amask(value)
    if isinstance(value, list):
        return [await masked_json(item, amask) for item in value]
    if isinstance(value, dict):
        return {key: await masked_json(item, amask) for key, item in value.items()}
    return value
