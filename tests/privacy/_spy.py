"""A spy over the real SQLite vault store: it counts the reads of sealed values and records
whether each ran on an event loop's thread (where a blocking read stalls every other turn); it
runs its calls for an event loop as a store on a server does (off the loop), not inline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from keel.privacy import StoredKey, VaultStore
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore

__all__ = ["SpyVaultStore"]

_T = TypeVar("_T")


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SpyVaultStore(SQLiteVaultStore):
    """The real SQLite vault store; ``reads_on_loop`` has one entry per read of sealed values,
    ``writes_on_loop`` one per look-up of numbers and write of values: True when it ran on a
    thread with a running event loop."""

    def __init__(self, db: SQLiteDatabase) -> None:
        super().__init__(db)
        self.reads_on_loop: list[bool] = []
        self.writes_on_loop: list[bool] = []

    def numbers(
        self, tenant_id: str, user_id: str, tokens: Sequence[bytes]
    ) -> dict[bytes, tuple[str, int]]:
        self.writes_on_loop.append(_on_event_loop())
        return super().numbers(tenant_id, user_id, tokens)

    def add_values(
        self,
        tenant_id: str,
        user_id: str,
        values: Sequence[tuple[str, bytes, bytes]],
        *,
        key: StoredKey,
    ) -> list[int] | None:
        self.writes_on_loop.append(_on_event_loop())
        return super().add_values(tenant_id, user_id, values, key=key)

    async def acall(self, call: Callable[[], _T]) -> _T:
        # As a store on a server runs its calls (the interface's default), not inline as the
        # SQLite store may: what is checked is that the turn hands its reads to ``acall``.
        return await VaultStore.acall(self, call)

    @property
    def sealed_reads(self) -> int:
        return len(self.reads_on_loop)

    def sealed(
        self, tenant_id: str, user_id: str, refs: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[bytes, bytes] | None]:
        self.reads_on_loop.append(_on_event_loop())
        return super().sealed(tenant_id, user_id, refs)
