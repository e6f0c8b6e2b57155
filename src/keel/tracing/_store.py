"""The interface every trace backend implements, with async twins.

A backend implements the synchronous methods; the ``a``-prefixed twins run them on keel's
blocking pool by default so an event loop is never blocked by a database round trip. A
backend that can do better overrides the twins (the SQL store runs the same plans through its
database's ``arun``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from keel._bridge import run_blocking
from keel.errors import UsageError
from keel.tracing._fields import Final
from keel.tracing._models import (
    Run,
    RunDetail,
    RunQuery,
    RunStatus,
    SessionStats,
    StatsThresholds,
    Step,
    StepMetric,
)
from keel.tracing._stats import session_stats

__all__ = ["RunEnding", "TraceBatch", "TraceStore"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RunEnding:
    """How a run ended: the arguments of [`TraceStore.end_run`][]."""

    run_id: str
    status: RunStatus
    ended_at: datetime
    output: str | None = None
    error_type: str | None = None
    error_message: str | None = None


@dataclass(frozen=True, slots=True)
class TraceBatch:
    """A buffered run's writes taken out of it (see
    [`RunTrace.take_batch`][keel.tracing.RunTrace.take_batch]): the header when not stored
    yet, the steps, and with [`RunTrace.take_end`][keel.tracing.RunTrace.take_end] the run's
    end, for ``store``."""

    store: TraceStore
    run_id: str
    run: Run | None
    steps: list[Step]
    final: Final | None = None

    @property
    def end(self) -> RunEnding | None:
        """The run's end as the store writes it (None for a batch of steps)."""
        return None if self.final is None else RunEnding(self.run_id, *self.final)


class TraceStore(ABC):
    """Where runs and steps are kept: write, query, and derive per-session indicators.

    Contract (checked by `keel.testing.trace_conformance` for every backend):

    - ``start_run`` inserts a run; starting an existing run id again replaces its header but
      keeps its steps and totals.
    - ``write_step`` inserts or replaces a step by ``(run_id, step_id)`` and keeps the run's
      totals (steps, calls, tool errors, tokens) exact, also when a step is rewritten.
    - ``end_run`` sets the final status, end time, output and error of a run.
    - Queries return runs newest first and steps in start order (``seq``).

    Sync/async contract: the sync methods are the interface; [`asetup`][],
    [`astart_run`][], [`awrite_step`][], [`awrite_batch`][], [`aend_run`][], [`aget_run`][],
    [`aget_run_detail`][], [`alist_runs`][], [`asession_stats`][] and [`aclose`][] are their
    async twins (same arguments, same result): each runs its sync method through
    [`acall`][] (keel's blocking pool) unless a backend overrides it. The other reads and
    [`delete_runs`][] are for the CLI and sync only.
    """

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` (blocking work on this store: a sync method, for its async twin) for
        an event loop: on keel's blocking pool by default; a backend that knows better
        overrides it (the SQL store runs it as its database runs a blocking call: on SQLite
        inline unless it would wait)."""
        return await run_blocking(call)

    @abstractmethod
    def setup(self) -> None:
        """Create or migrate the backend's tables; idempotent."""

    @abstractmethod
    def start_run(self, run: Run) -> None:
        """Insert ``run`` (status ``running`` as a rule)."""

    @abstractmethod
    def write_step(self, step: Step) -> None:
        """Insert or replace ``step`` and update its run's totals.

        Raises:
            StoreError: the write failed (the run may not exist, the database may be down).
        """

    @abstractmethod
    def end_run(
        self,
        run_id: str,
        *,
        status: RunStatus,
        ended_at: datetime,
        output: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        """Mark the run ended with ``status``."""

    @abstractmethod
    def get_run(self, run_id: str) -> Run | None:
        """The run with this id, or None."""

    @abstractmethod
    def get_steps(self, run_id: str) -> list[Step]:
        """Every step of the run, in start order."""

    @abstractmethod
    def list_runs(self, query: RunQuery | None = None) -> list[Run]:
        """Runs matching ``query``, newest first, at most ``query.limit``."""

    @abstractmethod
    def step_metrics(
        self,
        *,
        session_id: str | None = None,
        since: datetime | None = None,
        tenant_id: str | None = None,
    ) -> list[StepMetric]:
        """The columns the indicators need, for the matching steps, oldest first."""

    @abstractmethod
    def run_ids_starting_with(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Up to ``limit`` run ids that start with ``prefix`` (sorted), for short ids."""

    @abstractmethod
    def delete_runs(self, *, before: datetime) -> int:
        """Delete runs (and their steps) started before ``before``; returns how many."""

    def user_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        """The sessions the user's runs were in (where a user's erasure looks for what else of
        theirs there is). This default raises: a backend that erases implements it."""
        raise NotImplementedError(f"{type(self).__name__} cannot list a user's sessions")

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Delete every run of ``user_id`` in ``tenant_id`` with its steps (a user's erasure);
        ``{"trace_runs": ..., "trace_steps": ...}``. Idempotent. This default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot erase a user")

    @abstractmethod
    def close(self) -> None:
        """Release connections."""

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """Start ``run`` (when given), write ``steps`` and end the run (when ``end`` is
        given), in that order: what a buffered [`RunTrace`][] has gathered
        since its last flush. This default makes one call per item; a backend that can
        should do it in one transaction."""
        if run is not None:
            self.start_run(run)
        for step in steps:
            self.write_step(step)
        if end is not None:
            self.end_run(
                end.run_id,
                status=end.status,
                ended_at=end.ended_at,
                output=end.output,
                error_type=end.error_type,
                error_message=end.error_message,
            )

    # --- derived, shared by all backends ------------------------------------------------------

    def get_run_detail(self, run_id: str) -> RunDetail | None:
        """The run and its steps (use ``.tree()`` for the nested view), or None."""
        run = self.get_run(run_id)
        if run is None:
            return None
        return RunDetail(run=run, steps=tuple(self.get_steps(run_id)))

    def resolve_run_id(self, run_id_or_prefix: str) -> str | None:
        """The full id of the run ``run_id_or_prefix`` names exactly or as a unique prefix.

        Raises:
            UsageError: the prefix matches more than one run.
        """
        if self.get_run(run_id_or_prefix) is not None:
            return run_id_or_prefix
        matches = self.run_ids_starting_with(run_id_or_prefix, limit=2)
        if len(matches) > 1:
            raise UsageError(
                f"run id prefix {run_id_or_prefix!r} is ambiguous ({', '.join(matches)}, ...); "
                "give more characters"
            )
        return matches[0] if matches else None

    def session_stats(
        self,
        *,
        session_id: str | None = None,
        since: datetime | None = None,
        tenant_id: str | None = None,
        thresholds: StatsThresholds | None = None,
    ) -> list[SessionStats]:
        """Death-spiral indicators per session (one entry per session with steps or with
        abandoned runs)."""
        metrics = self.step_metrics(session_id=session_id, since=since, tenant_id=tenant_id)
        killed = self.list_runs(
            RunQuery(
                session_id=session_id,
                tenant_id=tenant_id,
                since=since,
                status="abandoned",
                limit=100_000,
            )
        )
        abandoned = Counter(run.session_id for run in killed)
        return session_stats(metrics, thresholds or StatsThresholds(), abandoned)

    # --- async twins --------------------------------------------------------------------------

    async def asetup(self) -> None:
        """Async twin of [`setup`][]."""
        await self.acall(self.setup)

    async def astart_run(self, run: Run) -> None:
        """Async twin of [`start_run`][]."""
        await self.acall(lambda: self.start_run(run))

    async def awrite_step(self, step: Step) -> None:
        """Async twin of [`write_step`][]."""
        await self.acall(lambda: self.write_step(step))

    async def awrite_batch(
        self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> None:
        """Async twin of [`write_batch`][]."""
        await self.acall(lambda: self.write_batch(run=run, steps=steps, end=end))

    async def aend_run(
        self,
        run_id: str,
        *,
        status: RunStatus,
        ended_at: datetime,
        output: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        """Async twin of [`end_run`][]."""
        await self.acall(
            lambda: self.end_run(
                run_id,
                status=status,
                ended_at=ended_at,
                output=output,
                error_type=error_type,
                error_message=error_message,
            )
        )

    async def aget_run(self, run_id: str) -> Run | None:
        """Async twin of [`get_run`][]."""
        return await self.acall(lambda: self.get_run(run_id))

    async def aget_run_detail(self, run_id: str) -> RunDetail | None:
        """Async twin of [`get_run_detail`][]."""
        return await self.acall(lambda: self.get_run_detail(run_id))

    async def alist_runs(self, query: RunQuery | None = None) -> list[Run]:
        """Async twin of [`list_runs`][]."""
        return await self.acall(lambda: self.list_runs(query))

    async def asession_stats(
        self,
        *,
        session_id: str | None = None,
        since: datetime | None = None,
        tenant_id: str | None = None,
        thresholds: StatsThresholds | None = None,
    ) -> list[SessionStats]:
        """Async twin of [`session_stats`][]."""
        return await self.acall(
            lambda: self.session_stats(
                session_id=session_id, since=since, tenant_id=tenant_id, thresholds=thresholds
            )
        )

    async def aclose(self) -> None:
        """Async twin of [`close`][]."""
        await self.acall(self.close)

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
