"""The API the runtime calls to trace runs: [`Tracer`][], [`RunTrace`][], [`StepTrace`][].

Failure policy: tracing must never break the agent. Every write (and the redaction and
serialisation before it, and every exporter) runs inside a guard: an exception is logged once as
a warning on the ``keel.tracing`` logger, counted in [`Tracer.write_failures`][] and kept in
[`Tracer.last_error`][], and the agent carries on. Exceptions raised by the agent's own code
inside a ``with run.step(...)`` block are recorded on the step and then re-raised unchanged.

Writes are synchronous and small (one row per step, one transaction) so a trace survives a
crash of the worker right after the step; a step is written when it ends, the run header when
it starts (so a crashed run stays visible as ``running``) and again when it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from datetime import UTC, datetime, timedelta
from itertools import count
from types import TracebackType
from typing import Any, Unpack

from pydantic_core import to_jsonable_python

from keel.errors import TurnInterruptedError
from keel.messages import Usage
from keel.models import Completion
from keel.tracing._fields import Final as _Final
from keel.tracing._fields import StepFields, TraceExporter, status_for
from keel.tracing._models import Run, RunQuery, RunStatus, Step, StepKind
from keel.tracing._redact import RedactionMemo, Redactor, redact_attributes, redact_json, redact_pii
from keel.tracing._stats import LOOP_GUARD_NAME
from keel.tracing._store import RunEnding, TraceBatch, TraceStore

__all__ = [
    "RunTrace",
    "StepFields",
    "StepTrace",
    "TraceExporter",
    "Tracer",
    "status_for",
]

logger = logging.getLogger("keel.tracing")

_TAKE_OVER_SCAN = 20
"""Runs of a session a take-over looks through, newest first: a turn left open is its newest."""

_CURRENT_STEP: ContextVar[StepTrace | None] = ContextVar("keel_current_step", default=None)


class _Auto:
    """Marker: take the parent from the innermost open ``with run.step(...)`` block."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()


def _now() -> datetime:
    return datetime.now(UTC)


def _new_id() -> str:
    return uuid.uuid4().hex


def _step_id() -> str:
    # 16 random hex digits, as a run id's first 16 were, without building a UUID per step.
    return os.urandom(8).hex()


def _from_completion(data: dict[str, Any], completion: Completion) -> None:
    message = completion.message
    raw = (
        json.dumps(message.to_openai(), ensure_ascii=False)
        if message.tool_calls
        else message.content
    )
    data.setdefault("usage", completion.usage)
    data.setdefault("model", completion.model)
    data.setdefault("finish_reason", completion.finish_reason)
    data.setdefault("raw_output", raw)
    if completion.ttft_ms is not None:
        data.setdefault("ttft_ms", completion.ttft_ms)
    data.setdefault("attempt", completion.attempts)


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data (models dumped, tuples and sets as lists, the rest as ``str``), in
    one pass in pydantic-core rather than a ``json`` round trip."""
    return to_jsonable_python(value, fallback=str)


class Tracer:
    """Records runs and their steps into a [`TraceStore`][], redacted, without ever raising.

    Args:
        store: where the trace goes. ``None`` traces into nothing (steps still get ids and
            exporters still run), which keeps agent code free of ``if tracer`` checks.
        redact: applied to every text field and to every string inside JSON fields before
            anything is stored or exported. Defaults to [`redact_pii`][]: every PII kind
            [`PIIMasker`][] masks (e-mail, phone, card, IBAN, SSN, IP, API
            keys...) and the credentials [`redact_secrets`][] knows. ``None`` turns masking
            off (explicit opt-out, e.g. for local debugging).
        exporters: receive each finished run with its steps (see [`OpenTelemetryExporter`][]).
        agent: default agent name for runs.
        run_time_limit_s: the wall-clock limit of the runs this tracer records (the runtime's
            ``GuardConfig.run_timeout_s``), unless ``start_run`` gives one. A run killed
            before it ended is reported ``abandoned`` once it has been silent for longer
            ([`abandon_after_s`][]); unknown, 300 s is assumed.
    """

    def __init__(
        self,
        store: TraceStore | None,
        *,
        redact: Redactor | None = redact_pii,
        exporters: Sequence[TraceExporter] = (),
        agent: str = "agent",
        run_time_limit_s: float | None = None,
    ) -> None:
        self.store = store
        self.run_time_limit_s = run_time_limit_s
        self.redact = redact if redact is not None else (lambda text: text)
        self.exporters = tuple(exporters)
        self.agent = agent
        self.write_failures = 0
        """How many trace writes (or exports) failed since this tracer was made."""
        self.last_error: BaseException | None = None
        """The most recent trace failure, for health checks."""

    # --- failure guard ------------------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        self.write_failures += 1
        self.last_error = exc
        logger.warning(
            "keel trace %s failed (%s: %s); the agent continues without it",
            what,
            type(exc).__name__,
            exc,
        )

    def _guard(self, what: str, action: Callable[[], None]) -> bool:
        try:
            action()
        except Exception as exc:  # tracing never breaks the agent
            self._failed(what, exc)
            return False
        return True

    # --- redaction ----------------------------------------------------------------------------

    @property
    def redact(self) -> Redactor:
        """What masks every text this tracer records (see the ``redact`` argument)."""
        return self._memo.redact

    @redact.setter
    def redact(self, redact: Redactor) -> None:
        # A turn's copy masking with the user's view keeps its own memo (sharing clean texts).
        self._memo = RedactionMemo(redact, getattr(self, "_memo", None))

    def _text(self, value: str | None, redact: Redactor | None = None) -> str | None:
        return None if value is None else (redact or self._memo.current())(value)

    def _json(self, value: Any, redact: Redactor | None = None) -> Any:
        redact = redact or self._memo.current()
        return None if value is None else redact_json(_jsonable(value), redact)

    # --- runs ---------------------------------------------------------------------------------

    def _new_run(
        self,
        session_id: str,
        user_id: str | None,
        tenant_id: str | None,
        agent: str | None,
        input: str | None,
        run_id: str | None,
        attributes: Mapping[str, Any] | None,
        time_limit_s: float | None = None,
    ) -> tuple[RunTrace, Run | None]:
        handle = RunTrace(
            self,
            run_id=run_id or _new_id(),
            session_id=session_id,
            user_id=user_id,
            tenant_id=tenant_id,
            agent=agent or self.agent,
        )
        header: Run | None = None
        try:
            header = Run(
                run_id=handle.run_id,
                session_id=session_id,
                user_id=user_id,
                tenant_id=tenant_id,
                agent=handle.agent,
                status="running",
                started_at=handle.started_at,
                input=self._text(input),
                attributes=redact_attributes(attributes, self._json),
                time_limit_s=time_limit_s if time_limit_s is not None else self.run_time_limit_s,
            )
        except Exception as exc:
            self._failed("run start", exc)
        handle._header = header
        return handle, header

    def start_run(
        self,
        session_id: str,
        *,
        user_id: str | None = None,
        tenant_id: str | None = None,
        agent: str | None = None,
        input: str | None = None,
        run_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        time_limit_s: float | None = None,
    ) -> RunTrace:
        """Start a run and write its header (status ``running``). Never raises.

        Use the result as a context manager to end the run automatically: on a clean exit it
        ends ``succeeded``, on an exception with [`status_for`][] of it (re-raised).
        ``time_limit_s`` is the run's wall-clock limit (default: the tracer's): a run killed
        before it ends is reported ``abandoned`` once silent for longer than that allows.
        """
        handle, header = self._new_run(
            session_id, user_id, tenant_id, agent, input, run_id, attributes, time_limit_s
        )
        store = self.store
        if header is not None and store is not None:
            handle._stored = self._guard("run start", lambda: store.start_run(header))
        return handle

    async def astart_run(
        self,
        session_id: str,
        *,
        user_id: str | None = None,
        tenant_id: str | None = None,
        agent: str | None = None,
        input: str | None = None,
        run_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        time_limit_s: float | None = None,
        buffered: bool = False,
    ) -> RunTrace:
        """Async twin of [`start_run`][] (the write does not block the event loop).

        ``buffered``: the header and the steps are kept in memory and written together, in
        one batch, by [`RunTrace.aflush`][] and by [`RunTrace.aend`][] (which writes the
        end in the same batch). A runtime that flushes at its own durable points (keel's
        Agent: before each model call, next to the checkpoint) pays one write per point
        instead of one per step; what a killed process loses is what came after its last
        flush, which its checkpoint does not hold either.
        """
        handle, header = self._new_run(
            session_id, user_id, tenant_id, agent, input, run_id, attributes, time_limit_s
        )
        handle._buffered = buffered
        if header is not None and self.store is not None and not buffered:
            try:
                await self.store.astart_run(header)
                handle._stored = True
            except Exception as exc:
                self._failed("run start", exc)
        return handle

    def _resumed(self, run: Run, steps: Sequence[Step]) -> tuple[RunTrace, Run]:
        handle = RunTrace(
            self,
            run_id=run.run_id,
            session_id=run.session_id,
            user_id=run.user_id,
            tenant_id=run.tenant_id,
            agent=run.agent,
        )
        handle.started_at = run.started_at
        handle._seq = count(max((step.seq for step in steps), default=-1) + 1)
        header = run.model_copy(
            update={
                "status": "running",
                "ended_at": None,
                "error_type": None,
                "error_message": None,
            }
        )
        handle._header = header
        return handle, header

    def resume_run(self, run_id: str) -> RunTrace | None:
        """Continue a stored run after a crash or restart (a new worker resuming a session).

        The run is marked ``running`` again, keeps its steps and totals, and new steps are
        ordered after the existing ones. Returns None (and counts a failure) when the run
        cannot be read; never raises.
        """
        store = self.store
        if store is None:
            return None
        try:
            run = store.get_run(run_id)
            if run is None:
                raise LookupError(f"no run {run_id!r} to resume")
            handle, header = self._resumed(run, store.get_steps(run_id))
            store.start_run(header)
            handle._stored = True
        except Exception as exc:
            self._failed("run resume", exc)
            return None
        return handle

    async def aresume_run(self, run_id: str) -> RunTrace | None:
        """Async twin of [`resume_run`][]."""
        store = self.store
        if store is None:
            return None
        try:
            run = await store.aget_run(run_id)
            if run is None:
                raise LookupError(f"no run {run_id!r} to resume")
            detail = await store.aget_run_detail(run_id)
            handle, header = self._resumed(run, detail.steps if detail else ())
            await store.astart_run(header)
            handle._stored = True
        except Exception as exc:
            self._failed("run resume", exc)
            return None
        return handle

    async def atake_over_turn(self, run: RunTrace, turn_id: str) -> int:
        """``run`` finishes the open turn ``turn_id``: the earlier runs of that turn that never
        ended (their process was killed or crashed mid-turn) end as ``interrupted``, saying
        which run took the turn over, instead of reading as ``running`` and later
        ``abandoned``. The caller holds the session, so none of them is still working on it.
        Returns how many runs it ended; never raises (a failure is counted, as for writes).
        """
        store = self.store
        if store is None:
            return 0
        reason = (
            f"run {run.run_id[:12]} took its turn over: this run stopped before the turn ended "
            "(its process was killed or crashed)"
        )
        try:
            stale = [
                found
                for status in ("running", "abandoned")
                for found in await store.alist_runs(
                    RunQuery(
                        session_id=run.session_id,
                        tenant_id=run.tenant_id,
                        status=status,
                        limit=_TAKE_OVER_SCAN,
                    )
                )
                if found.attributes.get("turn_id") == turn_id and found.run_id != run.run_id
            ]
            for found in stale:
                await store.aend_run(
                    found.run_id,
                    status="interrupted",
                    ended_at=_now(),
                    output=None,
                    error_type=TurnInterruptedError.__name__,
                    error_message=reason,
                )
        except Exception as exc:
            self._failed("run take-over", exc)
            return 0
        return len(stale)

    def _export(self, run: Run, steps: Sequence[Step]) -> None:
        for exporter in self.exporters:
            try:
                exporter.export(run, steps)
            except Exception as exc:  # an exporter never breaks the agent either
                self._failed("export", exc)


class RunTrace:
    """One run being traced. Made by [`Tracer.start_run`][]; ended by [`end`][]."""

    def __init__(
        self,
        tracer: Tracer,
        *,
        run_id: str,
        session_id: str,
        user_id: str | None,
        tenant_id: str | None,
        agent: str,
    ) -> None:
        self.tracer = tracer
        self.run_id = run_id
        """The run's id (also in every step row)."""
        self.session_id = session_id
        self.user_id = user_id
        self.tenant_id = tenant_id
        self.agent = agent
        self.started_at = _now()
        self.status: RunStatus = "running"
        """``running`` until [`end`][]."""
        self._seq = count()
        self._header: Run | None = None
        # False until the header is in the store; a failed start (a locked database, a blip
        # in the connection) is retried before the next write so the run's steps still land.
        self._stored = False
        self._finished: list[Step] = []
        self._buffered = False
        self._pending: list[Step] = []

    # --- steps --------------------------------------------------------------------------------

    def step(
        self,
        kind: StepKind,
        name: str = "",
        *,
        parent: StepTrace | str | _Auto | None = AUTO,
        **fields: Unpack[StepFields],
    ) -> StepTrace:
        """Open a step that starts now; use it with ``with`` or ``async with``.

        The step is written when the block exits (or on [`StepTrace.end`][]), with its end
        time and latency. An exception leaving the block is recorded as the step's error and
        re-raised. Steps opened inside the block get this step as their parent unless
        ``parent`` says otherwise (a step, a step id, or None for a top-level step).
        """
        return StepTrace(self, kind, name, parent=self._parent_id(parent), fields=fields)

    def _parent_id(self, parent: StepTrace | str | _Auto | None) -> str | None:
        if isinstance(parent, _Auto):
            current = _CURRENT_STEP.get()
            return current.step_id if current is not None and current.run is self else None
        if isinstance(parent, StepTrace):
            return parent.step_id
        return parent

    def record(
        self,
        kind: StepKind,
        name: str = "",
        *,
        parent: StepTrace | str | _Auto | None = AUTO,
        started_at: datetime | None = None,
        ended_at: datetime | None = None,
        **fields: Unpack[StepFields],
    ) -> Step | None:
        """Write a step that has already happened (an event, or a call timed elsewhere).

        ``started_at``/``ended_at`` default to now; ``latency_ms`` defaults to their
        difference. Returns the stored (redacted) step, or None if building it failed.
        """
        step = self._build(kind, name, self._parent_id(parent), started_at, ended_at, fields)
        if step is not None:
            self._write(step)
        return step

    async def arecord(
        self,
        kind: StepKind,
        name: str = "",
        *,
        parent: StepTrace | str | _Auto | None = AUTO,
        started_at: datetime | None = None,
        ended_at: datetime | None = None,
        **fields: Unpack[StepFields],
    ) -> Step | None:
        """Async twin of [`record`][]."""
        step = self._build(kind, name, self._parent_id(parent), started_at, ended_at, fields)
        if step is not None:
            await self._awrite(step)
        return step

    def transition(self, source: str, target: str, **fields: Unpack[StepFields]) -> Step | None:
        """Record a state-machine transition ``source -> target`` (name ``"source->target"``);
        pass ``state_version=`` for the version it produced."""
        fields["attributes"] = {
            "source": source,
            "target": target,
            **dict(fields.get("attributes") or {}),
        }
        return self.record("transition", f"{source}->{target}", **fields)

    def state_reset(self, reason: str, **fields: Unpack[StepFields]) -> Step | None:
        """Record that the state machine was reset after persistent failures."""
        fields.setdefault("error_message", reason)
        return self.record("reset", "reset", **fields)

    def guard(self, name: str, message: str = "", **fields: Unpack[StepFields]) -> Step | None:
        """Record a guard event (``name`` e.g. ``"truncation"``, ``"step_limit"``)."""
        if message:
            fields.setdefault("error_message", message)
        return self.record("guard", name, **fields)

    def loop_caught(
        self, evidence: Sequence[str], *, escalated: bool = False, **fields: Unpack[StepFields]
    ) -> Step | None:
        """Record a loop the guards caught (counted as ``loops_caught`` in ``keel runs stats``).

        ``escalated`` is True when the run stopped (second detection) rather than being told
        to change approach."""
        fields["attributes"] = {
            "evidence": list(evidence),
            "escalated": escalated,
            **dict(fields.get("attributes") or {}),
        }
        fields.setdefault("error_type", "LoopDetectedError")
        fields.setdefault("error_message", "; ".join(evidence))
        return self.record("guard", LOOP_GUARD_NAME, **fields)

    # --- building and writing -----------------------------------------------------------------

    def _build(
        self,
        kind: StepKind,
        name: str,
        parent_id: str | None,
        started_at: datetime | None,
        ended_at: datetime | None,
        fields: StepFields,
        *,
        step_id: str | None = None,
        seq: int | None = None,
        measured_ms: float | None = None,
    ) -> Step | None:
        tracer = self.tracer
        try:
            redact = tracer._memo.current()
            data: dict[str, Any] = dict(fields)
            error = data.pop("error", None)
            if isinstance(error, BaseException):
                data.setdefault("error_type", type(error).__name__)
                data.setdefault("error_message", str(error))
            completion = data.pop("completion", None)
            if isinstance(completion, Completion):
                _from_completion(data, completion)
            usage = data.pop("usage", None)
            if isinstance(usage, Usage):
                data.setdefault("prompt_tokens", usage.prompt_tokens)
                data.setdefault("completion_tokens", usage.completion_tokens)
            start = started_at or _now()
            end = ended_at or _now()
            if data.get("latency_ms") is None:
                data["latency_ms"] = (
                    measured_ms
                    if measured_ms is not None
                    else max((end - start) / timedelta(milliseconds=1), 0.0)
                )
            for key in (
                "raw_output",
                "error_message",
                "model",
                "finish_reason",
                "tool_name",
                "tool_call_id",
            ):
                if isinstance(data.get(key), str):
                    data[key] = redact(data[key])
            arguments = data.get("tool_arguments")
            if arguments is not None and not isinstance(arguments, str):
                arguments = json.dumps(_jsonable(arguments), ensure_ascii=False)
            data["tool_arguments"] = tracer._text(arguments, redact)
            result = data.get("tool_result")
            if result is not None and not isinstance(result, str):
                result = json.dumps(_jsonable(result), ensure_ascii=False)
            data["tool_result"] = tracer._text(result, redact)
            for key in ("budget", "parsed_action"):
                if key in data:
                    data[key] = tracer._json(data[key], redact)
            data["attributes"] = tracer._json(dict(data.get("attributes") or {}), redact)
            return Step(
                run_id=self.run_id,
                step_id=step_id or _step_id(),
                parent_id=parent_id,
                seq=next(self._seq) if seq is None else seq,
                kind=kind,
                name=redact(name),
                started_at=start,
                ended_at=end,
                **data,
            )
        except Exception as exc:
            tracer._failed(f"step {kind}:{name}", exc)
            return None

    def _write(self, step: Step) -> None:
        if self.tracer.exporters:
            self._finished.append(step)
        store = self.tracer.store
        if store is None:
            return

        def write() -> None:
            self._ensure_stored(store)
            store.write_step(step)

        self.tracer._guard(f"step {step.kind}:{step.name}", write)

    def _ensure_stored(self, store: TraceStore) -> None:
        if not self._stored and self._header is not None:
            store.start_run(self._header)
            self._stored = True

    async def _aensure_stored(self, store: TraceStore) -> None:
        if not self._stored and self._header is not None:
            await store.astart_run(self._header)
            self._stored = True

    async def _awrite(self, step: Step) -> None:
        if self.tracer.exporters:
            self._finished.append(step)
        store = self.tracer.store
        if store is None:
            return
        if self._buffered:
            self._pending.append(step)
            return
        try:
            await self._aensure_stored(store)
            await store.awrite_step(step)
        except Exception as exc:
            self.tracer._failed(f"step {step.kind}:{step.name}", exc)

    async def aflush(self) -> None:
        """Write what a buffered run holds (its header, the steps since the last flush) in one
        batch. Never raises; a no-op for an unbuffered run. Steps of a batch that failed are
        dropped (logged), the header is tried again with the next batch."""
        await self._aflush_with(None)

    def flush(self) -> None:
        """Sync twin of [`aflush`][], for a caller that writes the batch inside its own
        transaction (the Agent makes it one commit with the checkpoint before a model call)."""
        self._flush_with(None)

    def _batch(self) -> tuple[TraceStore, Run | None, list[Step]] | None:
        store = self.tracer.store
        if store is None or not self._buffered:
            return None
        run = self._header if not self._stored else None
        steps, self._pending = self._pending, []
        return store, run, steps

    def _flush_with(self, end: RunEnding | None) -> None:
        batch = self._batch()
        if batch is None:
            return
        store, run, steps = batch
        if run is None and not steps and end is None:
            return
        try:
            store.write_batch(run=run, steps=steps, end=end)
        except Exception as exc:
            self._flush_failed(end, steps, exc)
            return
        if run is not None:
            self._stored = True

    async def _aflush_with(self, end: RunEnding | None) -> None:
        batch = self._batch()
        if batch is None:
            return
        store, run, steps = batch
        if run is None and not steps and end is None:
            return
        try:
            await store.awrite_batch(run=run, steps=steps, end=end)
        except Exception as exc:
            self._flush_failed(end, steps, exc)
            return
        if run is not None:
            self._stored = True

    def take_batch(self) -> TraceBatch | None:
        """What [`aflush`][] would write now (the header if not stored yet, the steps since
        the last flush), taken out of the run, for a caller that writes it in a transaction of
        its own (the turn's checkpoint before a model call: one commit for both). None when
        there is nothing to write. Hand it back with [`batch_written`][],
        [`batch_failed`][] or [`batch_returned`][], or write it with [`awrite`][]."""
        batch = self._batch()
        if batch is None:
            return None
        store, run, steps = batch
        if run is None and not steps:
            return None
        return TraceBatch(store, self.run_id, run, steps)

    def take_end(
        self,
        status: RunStatus | None = None,
        *,
        output: str | None = None,
        error: BaseException | None = None,
    ) -> TraceBatch | None:
        """[`aend`][]'s batch (what is pending and the run's end) taken out of the run, as
        [`take_batch`][] takes a flush's: the run ends when the batch is handed back written
        or failed (or written with [`awrite`][]); handed back unwritten, it runs on. None
        when the run is not buffered or has ended (end it with [`aend`][])."""
        batch = self._batch() if self.status == "running" else None
        if batch is None:
            return None
        store, run, steps = batch
        return TraceBatch(store, self.run_id, run, steps, self._final(status, output, error))

    def batch_written(self, batch: TraceBatch) -> None:
        """``batch`` was committed by its caller."""
        if batch.run is not None:
            self._stored = True
        self._ended(batch)

    def batch_failed(self, batch: TraceBatch, exc: Exception) -> None:
        """``batch`` failed to write: as a failed [`aflush`][] (logged, the steps dropped,
        the header tried again with the next batch)."""
        self._flush_failed(batch.end, batch.steps, exc)
        self._ended(batch)

    def batch_returned(self, batch: TraceBatch) -> None:
        """``batch`` was not written (rolled back): its steps go back for the next flush."""
        self._pending[:0] = batch.steps

    async def awrite(self, batch: TraceBatch) -> None:
        """Write ``batch`` on its own, as [`aflush`][] or [`aend`][] would. Never raises."""
        try:
            await batch.store.awrite_batch(run=batch.run, steps=batch.steps, end=batch.end)
        except Exception as exc:
            self.batch_failed(batch, exc)
            return
        self.batch_written(batch)

    def _ended(self, batch: TraceBatch) -> None:
        if batch.final is not None and self.status == "running":
            self.status = batch.final[0]
            self._exported(batch.final)

    def _flush_failed(self, end: RunEnding | None, steps: list[Step], exc: Exception) -> None:
        what = "run end" if end is not None else f"{len(steps)} steps"
        self.tracer._failed(what, exc)

    # --- ending -------------------------------------------------------------------------------

    def _finish(
        self, status: RunStatus | None, output: str | None, error: BaseException | None
    ) -> _Final | None:
        if self.status != "running":
            return None  # ended already; ending twice is a no-op
        final = self._final(status, output, error)
        self.status = final[0]
        return final

    def _final(
        self, status: RunStatus | None, output: str | None, error: BaseException | None
    ) -> _Final:
        """The run's end as it is written (redacted), the run not marked ended yet."""
        final = status or status_for(error)
        ended = _now()
        try:
            redacted_output = self.tracer._text(output)
            error_type = type(error).__name__ if error is not None else None
            error_message = self.tracer._text(str(error)) if error is not None else None
        except Exception as exc:
            self.tracer._failed("run end", exc)
            redacted_output = error_type = error_message = None
        return final, ended, redacted_output, error_type, error_message

    def _exported(self, final: _Final) -> None:
        if not self.tracer.exporters or self._header is None:
            return
        status, ended, output, error_type, error_message = final
        steps = list(self._finished)
        run = self._header.model_copy(
            update={
                "status": status,
                "ended_at": ended,
                "output": output,
                "error_type": error_type,
                "error_message": error_message,
                "step_count": len(steps),
                "model_calls": sum(1 for s in steps if s.kind == "model"),
                "tool_calls": sum(1 for s in steps if s.kind == "tool"),
                "tool_errors": sum(1 for s in steps if s.kind == "tool" and s.failed),
                "prompt_tokens": sum(s.prompt_tokens for s in steps),
                "completion_tokens": sum(s.completion_tokens for s in steps),
            }
        )
        self.tracer._export(run, steps)

    def end(
        self,
        status: RunStatus | None = None,
        *,
        output: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """End the run: ``status`` defaults to [`status_for`][] of ``error``. Never raises;
        a second call is ignored."""
        final = self._finish(status, output, error)
        if final is None:
            return
        store = self.tracer.store
        if store is not None and self._buffered:
            self._flush_with(RunEnding(self.run_id, *final))
        elif store is not None:
            status_, ended, out, error_type, error_message = final

            def write() -> None:
                self._ensure_stored(store)
                store.end_run(
                    self.run_id,
                    status=status_,
                    ended_at=ended,
                    output=out,
                    error_type=error_type,
                    error_message=error_message,
                )

            self.tracer._guard("run end", write)
        self._exported(final)

    async def aend(
        self,
        status: RunStatus | None = None,
        *,
        output: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Async twin of [`end`][]."""
        final = self._finish(status, output, error)
        if final is None:
            return
        store = self.tracer.store
        if store is not None and self._buffered:
            await self._aflush_with(RunEnding(self.run_id, *final))
        elif store is not None:
            status_, ended, out, error_type, error_message = final
            try:
                await self._aensure_stored(store)
                await store.aend_run(
                    self.run_id,
                    status=status_,
                    ended_at=ended,
                    output=out,
                    error_type=error_type,
                    error_message=error_message,
                )
            except Exception as exc:
                self.tracer._failed("run end", exc)
        self._exported(final)

    def __enter__(self) -> RunTrace:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end(error=exc)

    async def __aenter__(self) -> RunTrace:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aend(error=exc)

    def __repr__(self) -> str:
        return f"RunTrace(run_id={self.run_id!r}, session_id={self.session_id!r}, {self.status})"


class StepTrace:
    """A step in progress. Made by [`RunTrace.step`][]; written once, when it ends."""

    def __init__(
        self,
        run: RunTrace,
        kind: StepKind,
        name: str,
        *,
        parent: str | None,
        fields: StepFields,
    ) -> None:
        self.run = run
        self.kind: StepKind = kind
        self.name = name
        self.parent_id = parent
        self.step_id = _step_id()
        """The step's id; pass the StepTrace (or this id) as ``parent=`` to nest steps."""
        self.seq = next(run._seq)
        self.started_at = _now()
        self._t0 = time.perf_counter()
        self._fields: StepFields = StepFields(**fields)
        self._token: Token[StepTrace | None] | None = None
        self.ended = False

    def update(self, **fields: Unpack[StepFields]) -> None:
        """Set or overwrite fields of the step before it is written."""
        self._fields.update(fields)

    def first_token(self) -> None:
        """Mark now as the time the first token of a streamed answer arrived."""
        if "ttft_ms" not in self._fields:
            self._fields["ttft_ms"] = (time.perf_counter() - self._t0) * 1000

    def fail(self, error: BaseException) -> None:
        """Record ``error`` as the step's error (type and message)."""
        self._fields["error"] = error
        self._fields.pop("error_type", None)
        self._fields.pop("error_message", None)

    def _close(self, fields: StepFields) -> Step | None:
        if self.ended:
            return None
        self.ended = True
        self._fields.update(fields)
        return self.run._build(
            self.kind,
            self.name,
            self.parent_id,
            self.started_at,
            _now(),
            self._fields,
            step_id=self.step_id,
            seq=self.seq,
            measured_ms=(time.perf_counter() - self._t0) * 1000,
        )

    def end(self, **fields: Unpack[StepFields]) -> Step | None:
        """End and write the step now (for use without ``with``); later calls are ignored."""
        step = self._close(fields)
        if step is not None:
            self.run._write(step)
        return step

    async def aend(self, **fields: Unpack[StepFields]) -> Step | None:
        """Async twin of [`end`][]."""
        step = self._close(fields)
        if step is not None:
            await self.run._awrite(step)
        return step

    def _enter(self) -> None:
        self._token = _CURRENT_STEP.set(self)

    def _exit(self, exc: BaseException | None) -> None:
        if self._token is not None:
            # Exited in another context (a task switch): the variable there is not ours.
            with contextlib.suppress(ValueError):
                _CURRENT_STEP.reset(self._token)
            self._token = None
        if exc is not None and "error" not in self._fields and "error_type" not in self._fields:
            self.fail(exc)

    def __enter__(self) -> StepTrace:
        self._enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exit(exc)
        self.end()

    async def __aenter__(self) -> StepTrace:
        self._enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exit(exc)
        await self.aend()

    def __repr__(self) -> str:
        return f"StepTrace({self.kind}:{self.name}, step_id={self.step_id!r})"
