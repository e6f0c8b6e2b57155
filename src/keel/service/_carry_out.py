"""Each worker carries out what was decided elsewhere: a decision recorded on the command line
(``keel approvals approve``, which holds no agent and runs no tool) leads to its effect while
``keel serve`` runs, without the application noticing.

Every ``every_s`` seconds a background task of each worker calls
``agent.carry_out_decisions()`` for each tenant with decisions left to carry out. Several
workers (or servers) doing so at once carry each decision out once: a parked turn goes on
under its session's lease, its state read again there, its tool calls through the journal.
While the server drains, no new pass starts; at shutdown the pass in flight finishes (or,
past a bound, is cancelled: its turn goes on later, whole) before the stores close. A pass
is not a client's turn: it never counts in the drain's turns in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from keel.errors import UsageError

if TYPE_CHECKING:
    from keel.approvals import ApprovalStore
    from keel.runtime import Agent
    from keel.service._drain import Drain

__all__ = ["DEFAULT_EVERY_S", "DecisionCarrier", "carrying_out", "service_carrier"]

DEFAULT_EVERY_S = 2.0
"""How often a worker looks for decisions to carry out (seconds)."""

_BOUNDS_S = (0.05, 3600.0)
"""The interval's allowed range: often enough to matter, rarely enough not to load the store."""

_STOP_WAIT_S = 30.0
"""The longest shutdown waits for a pass in flight before it cancels it (the turn it cancels
stays open or parked, and goes on later: the lease and the journal keep it whole)."""

logger = logging.getLogger("keel.service")


class DecisionCarrier:
    """One worker's carrying out of decisions made elsewhere (see the module docstring).

    Args:
        agent_for: the tenant's agent (the service's, made on first use).
        tenants: the tenants to look at (awaited when it returns an awaitable).
        every_s: seconds between passes (0.05 to 3600).
        drain: the server's drain: no pass starts while it drains.

    Raises:
        UsageError: ``every_s`` is out of range.
    """

    def __init__(
        self,
        agent_for: Callable[[str], Agent],
        tenants: Callable[[], Iterable[str] | Awaitable[Iterable[str]]],
        *,
        every_s: float = DEFAULT_EVERY_S,
        drain: Drain | None = None,
    ) -> None:
        low, high = _BOUNDS_S
        if not low <= every_s <= high:
            raise UsageError(f"carry-out interval must be {low} to {high} s, not {every_s}")
        self.agent_for = agent_for
        self.tenants = tenants
        self.every_s = every_s
        self.drain = drain
        self._stop = asyncio.Event()

    async def pass_once(self) -> int:
        """Carry out, for every tenant, what waits to be; how many turns went on."""
        found = self.tenants()
        tenants = await found if isinstance(found, Awaitable) else found
        went_on = 0
        for tenant_id in dict.fromkeys(tenants):
            if self._stop.is_set() or self._draining():
                break
            agent = self.agent_for(tenant_id)
            if agent.approvals is None:
                continue
            went_on += len(await agent.carry_out_decisions())
        return went_on

    async def run(self) -> None:
        """Pass after pass until `stop`; a failing pass is logged, never the worker's."""
        while not self._stop.is_set():
            if not self._draining():
                try:
                    went_on = await self.pass_once()
                    if went_on:
                        logger.info("carried out decisions: %d turns went on", went_on)
                except Exception:
                    logger.exception("carrying out decisions failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every_s)

    def arm(self) -> None:
        """Ready for a new `run` (an app's lifespan may run more than once)."""
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """No new pass starts; the one in flight finishes."""
        self._stop.set()

    def _draining(self) -> bool:
        return self.drain is not None and self.drain.draining


@contextlib.asynccontextmanager
async def carrying_out(carrier: DecisionCarrier | None) -> AsyncIterator[None]:
    """``carrier`` running in the background for the block (None: nothing runs)."""
    if carrier is None:
        yield
        return
    carrier.arm()
    task = asyncio.create_task(carrier.run(), name="keel-carry-out-decisions")
    try:
        yield
    finally:
        carrier.stop()
        try:
            await asyncio.wait_for(task, _STOP_WAIT_S)
        except TimeoutError:
            logger.warning("a pass carrying out decisions was cancelled at shutdown")


def service_carrier(
    agent_for: Callable[[str], Agent],
    approvals: ApprovalStore,
    *,
    every_s: float,
    drain: Drain | None,
) -> DecisionCarrier:
    """The service's carrier: each pass looks at the tenants the queue holds decisions left
    to carry out for (read from its index of those), not at every tenant or key."""
    return DecisionCarrier(agent_for, approvals.atenants_to_carry_out, every_s=every_s, drain=drain)
