"""Each worker applies memory's retention policies on a schedule (``memory_prune_every_s``).

Every interval a background task of each worker runs one pruning
([`prune_memory`][keel.memory.prune_memory]) on keel's blocking pool. Pruning is deletes
only, each idempotent, so several workers (or servers) pruning the same database at once need
no lease: whoever comes second finds nothing left to delete. The first pass runs one interval
after start-up (a restart loop never prunes in a burst); a failing pass is logged and the next
one tries again; at shutdown the pass in flight finishes before the stores close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from keel._bridge import run_blocking
from keel.memory import PruneReport, RetentionPolicies, prune_memory

if TYPE_CHECKING:
    from keel.memory import MemoryStore

__all__ = ["MemoryPruner", "pruning", "service_pruner"]

logger = logging.getLogger("keel.service")


class MemoryPruner:
    """One worker's pruning of ``store`` by ``policies``, every ``every_s`` seconds."""

    def __init__(self, store: MemoryStore, policies: RetentionPolicies, every_s: float) -> None:
        self.store = store
        self.policies = policies
        self.every_s = every_s
        self._stop = asyncio.Event()

    async def pass_once(self) -> PruneReport:
        """Apply the policies once; what went."""
        return await run_blocking(prune_memory, self.store, self.policies)

    async def run(self) -> None:
        """Pass after pass, one interval apart, until `stop`."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every_s)
            if self._stop.is_set():
                return
            try:
                report = await self.pass_once()
                if report.total:
                    logger.info("memory retention: %d records pruned", report.total)
            except Exception:
                logger.exception("memory retention failed; trying again next interval")

    def arm(self) -> None:
        """Ready for a new `run` (an app's lifespan may run more than once)."""
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """No new pass starts; the one in flight finishes."""
        self._stop.set()


@contextlib.asynccontextmanager
async def pruning(pruner: MemoryPruner | None) -> AsyncIterator[None]:
    """``pruner`` running in the background for the block (None: nothing runs)."""
    if pruner is None:
        yield
        return
    pruner.arm()
    task = asyncio.create_task(pruner.run(), name="keel-memory-retention")
    try:
        yield
    finally:
        pruner.stop()
        await task


def service_pruner(
    store: MemoryStore | None, policies: RetentionPolicies, every_s: float
) -> MemoryPruner | None:
    """The worker's pruner, or None when there is nothing to prune on (no memory, no policy,
    or an interval of 0)."""
    if store is None or policies.empty or every_s <= 0:
        return None
    return MemoryPruner(store, policies, every_s)
