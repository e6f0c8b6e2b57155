"""The exactly-once journal: intents and results of side-effecting tool calls.

Before a side-effecting tool runs, its intent is written under an idempotency key derived from
(session, step, call); after it runs, its result. The write of the intent is an atomic claim:
whoever inserts it runs the tool, anyone else finds the entry. After a crash the entry says what
happened: a recorded result is returned without running again, an intent without a result is
*in doubt*.

The journal also keeps each step's *decision* (the assistant message with its tool calls), so
a resumed run replays the same calls instead of asking the model again and getting new ones.
"""

from __future__ import annotations

import hashlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_blocking
from keel.messages import Message

__all__ = [
    "SETTLED_NOTE",
    "InMemoryJournal",
    "JournalClaim",
    "JournalEntry",
    "JournalStatus",
    "ToolJournal",
    "idempotency_key",
]

_T = TypeVar("_T")

SETTLED_NOTE = "[settled by an operator] "
"""Starts the journalled ``output`` of a call an operator settled ([`ToolJournal.resolve`][]):
the model never saw it done, so a repeat of the same call gets this result instead of running
again (see [`ToolExecutor`][])."""

JournalStatus = Literal["started", "succeeded", "failed"]
"""``started``: intent written, no result yet. ``succeeded``/``failed``: the result is recorded."""


def idempotency_key(session_id: str, step: int, call_index: int, turn_id: str | None = None) -> str:
    """The key of one tool call: stable across processes, safe to pass to external APIs.

    ``turn_id`` (the Agent's id of the turn in flight, kept in its checkpoints) makes keys
    unique to one turn: two writers that ever reached the same step number of a session
    cannot share a key, while a resumed turn, which keeps its id, finds its own entries.
    """
    material = f"{session_id}\x00{step}\x00{call_index}"
    if turn_id is not None:
        material += f"\x00{turn_id}"
    digest = hashlib.sha256(material.encode()).hexdigest()
    return f"keel-{digest[:32]}"


class JournalEntry(BaseModel):
    """One journalled side-effecting call."""

    model_config = ConfigDict(frozen=True)

    key: str = Field(description="Idempotency key from (session, step, call).")
    session_id: str = Field(description="The session the call belongs to.")
    step: int = Field(ge=0, description="The step of the run that made the call.")
    call_index: int = Field(ge=0, description="Position of the call in the step's tool calls.")
    tool: str = Field(description="Name of the tool.")
    arguments: str = Field(description="The validated arguments, as canonical JSON.")
    status: JournalStatus = Field(description="Whether a result has been recorded.")
    ok: bool | None = Field(default=None, description="Whether the recorded call succeeded.")
    content: str | None = Field(
        default=None, description="What the model was (or will be) shown as the result."
    )
    output: str | None = Field(
        default=None, description="The whole output, as text, for traces and operators."
    )
    attempts: int = Field(default=1, ge=1, description="How many times the tool was started.")
    started_at: float = Field(description="Unix time the intent was written.")
    finished_at: float | None = Field(default=None, description="Unix time of the result.")

    @property
    def in_doubt(self) -> bool:
        """True when the call started and no result was recorded (it may or may not have run)."""
        return self.status == "started"


class JournalClaim(BaseModel):
    """The answer to [`ToolJournal.claim`][]: did this caller create the intent?"""

    model_config = ConfigDict(frozen=True)

    created: bool = Field(description="True: the intent is new and the caller runs the tool.")
    entry: JournalEntry = Field(description="The entry as stored now.")


class ToolJournal(ABC):
    """Where intents, results and step decisions of side-effecting calls are kept.

    Implementations must make [`claim`][] atomic (insert-if-absent) and durable before it
    returns: the tool runs only after its intent is on disk.

    Sync/async contract: the sync methods are the interface; [`aclaim`][], [`arestart`][],
    [`afinish`][], [`aget`][], [`asame_calls`][], [`arecord_decision`][] and [`adecision`][]
    are their async twins (same arguments, same result). By default a twin runs its sync
    method through [`acall`][] (keel's blocking pool); a store may override a twin to do the
    same natively (the SQL journal runs the same plan through its database's ``arun``).
    [`entries`][], [`resolve`][] and [`in_doubt`][] are operator tools and sync only.
    """

    @abstractmethod
    def claim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        """Write the intent unless an entry with ``key`` exists; return what is stored."""

    @abstractmethod
    def restart(self, key: str) -> JournalEntry:
        """Count one more attempt of an in-doubt call that is about to run again."""

    @abstractmethod
    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        """Record the result of the call ``key``."""

    @abstractmethod
    def get(self, key: str) -> JournalEntry | None:
        """The entry for ``key``, if any."""

    @abstractmethod
    def entries(
        self, session_id: str | None = None, *, in_doubt_only: bool = False
    ) -> list[JournalEntry]:
        """Entries (of one session, or all), oldest first; ``in_doubt_only`` for operators."""

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        """Entries of ``session_id`` for ``tool`` with exactly these canonical ``arguments``,
        oldest first, whatever their key (step).

        The executor asks before running a non-idempotent call under a new key: while an
        earlier identical call is in doubt, running this one could do the same thing twice.
        Backends override this with an indexed query; the default filters [`entries`][].
        """
        return [
            entry
            for entry in self.entries(session_id)
            if entry.tool == tool and entry.arguments == arguments
        ]

    @abstractmethod
    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        """Keep the assistant message a step decided on; the first one written wins."""

    @abstractmethod
    def decision(self, session_id: str, step: int) -> Message | None:
        """The assistant message recorded for (session, step), if any."""

    def resolve(self, key: str, *, ok: bool, content: str) -> JournalEntry:
        """Operator action: record the outcome of an in-doubt call (after checking by hand).

        A resumed run then returns ``content`` to the model instead of raising, and a repeat
        of the same call gets it too instead of running again (settled as succeeded).
        """
        return self.finish(key, ok=ok, content=content, output=SETTLED_NOTE + content)

    def in_doubt(self, session_id: str | None = None) -> list[JournalEntry]:
        """Calls that started and recorded no result: an operator must look at them."""
        return self.entries(session_id, in_doubt_only=True)

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Delete every entry and decision of the sessions ``session_ids`` (a user's erasure),
        decisions recorded per turn (``<session>#<turn>``) included; what was removed, by
        table (``{"tool_journal": ..., "tool_decisions": ...}``). Idempotent.

        Operator tool, sync only. This default raises: a journal that keeps entries across
        processes must implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot erase sessions")

    # --- async twins: what an event loop calls ----------------------------------------------

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` (blocking work on this journal: a sync method, for its async twin)
        for an event loop: on keel's blocking pool by default, so a database round trip never
        blocks the event loop."""
        return await run_blocking(call)

    async def aclaim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        """Async twin of [`claim`][]."""
        return await self.acall(
            lambda: self.claim(
                key=key,
                session_id=session_id,
                step=step,
                call_index=call_index,
                tool=tool,
                arguments=arguments,
            )
        )

    async def arestart(self, key: str) -> JournalEntry:
        """Async twin of [`restart`][]."""
        return await self.acall(lambda: self.restart(key))

    async def afinish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        """Async twin of [`finish`][]."""
        return await self.acall(lambda: self.finish(key, ok=ok, content=content, output=output))

    async def aget(self, key: str) -> JournalEntry | None:
        """Async twin of [`get`][]."""
        return await self.acall(lambda: self.get(key))

    async def asame_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        """Async twin of [`same_calls`][]."""
        return await self.acall(lambda: self.same_calls(session_id, tool, arguments))

    async def arecord_decision(self, session_id: str, step: int, message: Message) -> Message:
        """Async twin of [`record_decision`][]."""
        return await self.acall(lambda: self.record_decision(session_id, step, message))

    async def adecision(self, session_id: str, step: int) -> Message | None:
        """Async twin of [`decision`][]."""
        return await self.acall(lambda: self.decision(session_id, step))


class InMemoryJournal(ToolJournal):
    """A journal in this process's memory: exactly-once within a process, not across crashes.

    The default when no durable journal is configured; use the SQLite or PostgreSQL journal
    for crash safety.
    """

    async def acall(self, call: Callable[[], _T]) -> _T:
        return call()  # memory only: nothing to wait for

    def __init__(self) -> None:
        self._entries: dict[str, JournalEntry] = {}
        self._decisions: dict[tuple[str, int], Message] = {}
        self._lock = threading.Lock()

    def claim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                return JournalClaim(created=False, entry=existing)
            entry = JournalEntry(
                key=key,
                session_id=session_id,
                step=step,
                call_index=call_index,
                tool=tool,
                arguments=arguments,
                status="started",
                started_at=time.time(),
            )
            self._entries[key] = entry
            return JournalClaim(created=True, entry=entry)

    def restart(self, key: str) -> JournalEntry:
        with self._lock:
            entry = self._require(key)
            updated = entry.model_copy(update={"attempts": entry.attempts + 1})
            self._entries[key] = updated
            return updated

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        with self._lock:
            entry = self._require(key)
            updated = entry.model_copy(
                update={
                    "status": "succeeded" if ok else "failed",
                    "ok": ok,
                    "content": content,
                    "output": output,
                    "finished_at": time.time(),
                }
            )
            self._entries[key] = updated
            return updated

    def get(self, key: str) -> JournalEntry | None:
        with self._lock:
            return self._entries.get(key)

    def entries(
        self, session_id: str | None = None, *, in_doubt_only: bool = False
    ) -> list[JournalEntry]:
        with self._lock:
            found = [
                entry
                for entry in self._entries.values()
                if (session_id is None or entry.session_id == session_id)
                and (not in_doubt_only or entry.in_doubt)
            ]
        return sorted(found, key=lambda entry: (entry.started_at, entry.step, entry.call_index))

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        with self._lock:
            return self._decisions.setdefault((session_id, step), message)

    def decision(self, session_id: str, step: int) -> Message | None:
        with self._lock:
            return self._decisions.get((session_id, step))

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        sessions = set(session_ids)

        def doomed(session_id: str) -> bool:
            return session_id in sessions or session_id.split("#", 1)[0] in sessions

        with self._lock:
            entries = [key for key, entry in self._entries.items() if doomed(entry.session_id)]
            decisions = [key for key in self._decisions if doomed(key[0])]
            for key in entries:
                del self._entries[key]
            for pair in decisions:
                del self._decisions[pair]
        return {"tool_journal": len(entries), "tool_decisions": len(decisions)}

    def _require(self, key: str) -> JournalEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"no journal entry {key!r}")
        return entry


def entry_from_row(row: dict[str, Any]) -> JournalEntry:
    """A JournalEntry from a database row mapping (shared by the SQL backends)."""
    ok = row.get("ok")
    return JournalEntry(
        key=str(row["key"]),
        session_id=str(row["session_id"]),
        step=int(row["step"]),
        call_index=int(row["call_index"]),
        tool=str(row["tool"]),
        arguments=str(row["arguments"]),
        status=row["status"],
        ok=None if ok is None else bool(ok),
        content=row.get("content"),
        output=row.get("output"),
        attempts=int(row["attempts"]),
        started_at=float(row["started_at"]),
        finished_at=None if row.get("finished_at") is None else float(row["finished_at"]),
    )
