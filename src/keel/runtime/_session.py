"""A session's entrances, under its lease: a user's message, ``Agent.resume``,
``Agent.decide``, a carry-out pass and a revert, each loading the session once and deciding
what comes of it before one runner (`TurnRunner`) runs each turn that must run.

A message: the session is loaded (created on its first message, refused to another user or
tenant); a caller's retry of a turn is answered once (its recorded reply, or its open turn
finished); a session parked on a waiting call either stays parked (an operator decides), or
the model reads the message as the user's answer (a confirmation), or the decided turn goes
on first; a turn a crash left open is finished first (its reply attached as
``interrupted_turn``). Each turn after the first starts from the state the one before it
committed, never read again.

A decision is one compare-and-set in the approval store (``adecide`` on a pending request):
two deciders at once, or the same decision sent twice, settle it once. Whoever settled it,
the session then goes on under its lease: when every request it waits for is decided, its
turn resumes (the approved calls run once, through the journal); until then, nothing runs.
Only the tenant's operators decide (the agent is the tenant's), and for a confirmation the
session's own user too: anyone else gets [`AccessDeniedError`][], as for a
request that does not exist, so nothing tells them it does.

Owning a session for a turn is the state store's lease (`Lease`, `Sessions.own`), renewed in
the background while the turn runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack
from urllib.parse import quote

from keel.approvals import (
    ApprovalDecision,
    ApprovalRequest,
    ApprovalStatus,
    Channel,
    arguments_digest,
    check_corrected_arguments,
    repeats_standing,
)
from keel.errors import (
    AccessDeniedError,
    ApprovalSettledError,
    SessionBusyError,
    StoreError,
    TurnInterruptedError,
    UsageError,
)
from keel.privacy import maskable_json, storable
from keel.runtime._approvals import Approvals, pending_view, waiting_text
from keel.runtime._events import AgentEvent
from keel.runtime._log import SessionLogs
from keel.runtime._masking import Masking
from keel.runtime._reply import AgentReply, claimed_turn, recorded_reply
from keel.runtime._turn import RunExtras, TurnDeps, TurnRunner
from keel.state import AgentState, Checkpoint, SessionLock, SessionRuntime, StateStore
from keel.tools import validated_arguments

__all__ = [
    "CARRY_OUT_PAGE",
    "PARKING_GRACE_S",
    "RESUMING_GRACE_S",
    "DecideOptions",
    "Lease",
    "Sessions",
    "check_owner",
    "own_session",
    "require_id",
    "session_key",
    "user_text",
]

logger = logging.getLogger("keel.runtime")

Loaded = tuple[AgentState, int]
"""A session's state and its version, as loaded or as its last turn committed it."""

_UNBOUNDED_STEPS = 1_000_000_000
"""AgentState.max_steps for a session: per-run limits live in GuardConfig."""

CARRY_OUT_PAGE = 500
"""How many requests left to carry out `carry_out_decisions` reads at a time (it reads them
all, page after page: only the decided requests not yet carried out, never the history)."""

PARKING_GRACE_S = 60.0
"""How old a decision must be before a pass that finds its session not parked on it marks it
carried out (see `_gone_past`): longer than a request is stored before its turn parks on it."""

RESUMING_GRACE_S = 15.0
"""How long a decision made through a channel that goes on with the turn itself
(``agent.decide``, HTTP, the viewer) is left to it; past that (its process died before the
turn went on), it is carried out like one from the command line, which only records it."""


class DecideOptions(TypedDict, total=False):
    """``Agent.decide``'s keywords besides the session and the request."""

    approve: bool
    """Required: True approves the call (it runs), False rejects it (it never runs)."""
    by: str | None
    """The operator who decides (``"alice"`` is recorded as ``operator:alice``); required
    unless ``user_id`` is given."""
    note: str | None
    """Why, kept with the decision (masked like the user's text); for an escalation answered
    with ``action="answer"``, the answer the model is given."""
    arguments: str | None
    """Corrected arguments, one JSON object: the call runs with them instead of the requested
    ones (validated against the tool as the model's are)."""
    user_id: str | None
    """The user the request belongs to, confirming a call that waits for its user (a
    ``user`` approval) instead of an operator."""
    action: Literal["retry", "skip", "answer"] | None
    """For an escalation: run the stopped call again, skip it, or give the model ``note`` as
    the answer."""
    channel: Channel
    """Through which entrance the decision came, as recorded (default ``"agent"``)."""
    reveal: bool
    """Show the user's values in the reply (default True); False keeps their placeholders,
    as stored, for a decider who may not read them."""


class Lease:
    """This turn's ownership of a session: the store's lease, renewed in the background.

    The lease keeps well-behaved writers apart across threads and processes; correctness does
    not rest on it: every write is compare-and-set, and before each side effect the lease is
    renewed so a worker that stalled past it never acts on a session another one took over.
    """

    def __init__(self, lock: SessionLock, session_id: str) -> None:
        self.lock = lock
        self.session_id = session_id
        self.lost = False
        self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Renew the lease every third of its time to live until `end`: a timer on the loop,
        and a renewal task only when one is due (a turn shorter than that, nearly every one,
        starts none)."""
        if not self._ended and not self.lost:
            period = max(self.lock.ttl / 3, 0.05)
            self._timer = asyncio.get_running_loop().call_later(period, self._due)

    def _due(self) -> None:
        self._timer = None
        self._renewal = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        try:
            if not await self.lock.aacquire(0):
                self.lost = True
        except StoreError:
            logger.warning("could not renew the lease on session %s", self.session_id)
        # Checked after the await, not left to cancellation alone: a client library can
        # swallow a cancel that lands mid-command (asyncio.wait_for before Python 3.12 drops
        # one that races the inner result), and the lease would be renewed forever while the
        # turn waits for it to stop.
        self._renewal = None
        self.start()

    async def end(self) -> None:
        """Stop renewing: the turn is over (a renewal in flight is cancelled and waited for)."""
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        renewal = self._renewal
        if renewal is not None:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal

    async def check(self) -> None:
        """Renew now; raise when another owner has taken the session."""
        if not self.lost:
            try:
                self.lost = not await self.lock.aacquire(0)
            except StoreError as exc:
                raise TurnInterruptedError(
                    self.session_id, "its lease could not be renewed"
                ) from exc
        if self.lost:
            raise TurnInterruptedError(self.session_id, "another worker took its lease")


@contextlib.asynccontextmanager
async def own_session(
    store: StateStore[Any], key: str, *, ttl: float, wait_s: float
) -> AsyncIterator[Lease]:
    """Hold session ``key`` for the block: wait up to ``wait_s`` for its lease (else
    [`SessionBusyError`][]), renew it while the block runs, release it after."""
    lock = store.session_lock(key, ttl=ttl)
    if not await lock.aacquire(wait_s):
        raise SessionBusyError(key, wait_s)
    lease = Lease(lock, key)
    lease.start()
    try:
        yield lease
    finally:
        await lease.end()
        if not lease.lost:
            try:
                await lock.arelease()
            except StoreError:
                # It expires by itself; the next turn waits at most its time to live.
                logger.warning("could not release the lease on session %s", key)


@dataclass(frozen=True)
class _Message:
    """A user's message as the entry carries it: its user's dependencies, the session's lease
    and ids (store key, session, user), the text, where its events go, the call's options."""

    deps: TurnDeps
    lease: Lease
    ids: tuple[str, str, str]
    text: str
    emit: Callable[[AgentEvent], None] | None
    extras: RunExtras | None


class Sessions:
    """An agent's sessions as its turns reach them (see the module docstring): built by the
    agent over what it hands over (its `TurnDeps` and its kept session logs).

    Args:
        deps: the agent's dependencies.
        logs: the session logs the agent keeps.
        lease_ttl_s / wait_s: a turn's lease on its session, and how long to wait for it.
    """

    def __init__(
        self, deps: TurnDeps, logs: SessionLogs, *, lease_ttl_s: float, wait_s: float
    ) -> None:
        self.deps, self.logs = deps, logs
        self.lease_ttl_s, self.wait_s = lease_ttl_s, wait_s

    def key(self, session_id: str) -> str:
        """The store key of ``session_id`` in the agent's tenant."""
        return session_key(self.deps.tenant_id, session_id)

    @contextlib.asynccontextmanager
    async def own(self, key: str) -> AsyncIterator[Lease]:
        """The session's lease for a block (see `own_session`), the agent's MCP servers
        started first: a server starting holds no session."""
        await self.deps.workflow.mcp.open()
        async with own_session(
            self.deps.state, key, ttl=self.lease_ttl_s, wait_s=self.wait_s
        ) as lease:
            yield lease

    # --- the one runner ---------------------------------------------------------------------

    async def _turn(
        self,
        deps: TurnDeps,
        lease: Lease,
        ids: tuple[str, str, str],
        loaded: Loaded,
        text: str | None,
        emit: Callable[[AgentEvent], None] | None = None,
        extras: RunExtras | None = None,
    ) -> tuple[AgentReply, Loaded]:
        """One turn on the session ``loaded`` (``text``: the user's message; None finishes
        its open turn) with ``deps``, its user's (every way into a turn, a message, a resume,
        a decision, numbers through its user's vault): the reply, and the session as the turn
        left it."""
        if text is not None:
            # The message's new values go to the vault off the event loop; the turn's own mask
            # of it (as it starts) then finds it in the view's memo.
            await deps.masking.amask(storable(text))
        try:
            runner = TurnRunner(deps, self.logs, lease, ids, loaded, text, emit, extras)
            return await runner(), runner.writer.loaded
        except BaseException:
            # Whatever stopped the turn, the session's log may hold messages that were never
            # committed: the next turn builds it again from the store.
            self.logs.pop(ids[0], None)
            raise

    # --- a user's message -------------------------------------------------------------------

    async def answer(
        self,
        session_id: str,
        user_id: str,
        text: str,
        emit: Callable[[AgentEvent], None] | None,
        extras: RunExtras | None,
    ) -> AgentReply:
        """The reply to ``text`` from ``user_id`` on ``session_id`` (see the module)."""
        require_id("session_id", session_id)
        require_id("user_id", user_id)
        text = user_text(text)
        if extras is not None and extras.turn_id is not None:
            require_id("turn_id", extras.turn_id)
        key = self.key(session_id)
        async with self.own(key) as lease:
            ids = (key, session_id, user_id)
            loaded = await self._load(ids)
            # One view of the user's vault for the message, whatever turns it runs.
            deps = self.deps.for_user(user_id)
            message = _Message(deps, lease, ids, text, emit, extras)
            if loaded[0].runtime.awaiting and deps.approvals is not None:
                return await self._answer_parked(message, loaded)
            reply, _ = await self._message(message, loaded)
            return reply

    async def _load(self, ids: tuple[str, str, str]) -> Loaded:
        """The session, read once (created on its first message), refused to anyone else."""
        deps, key = self.deps, ids[0]
        # Read, never changed: the turn builds its state with model_copy and its own log.
        checkpoint = await deps.state.apeek(key)
        if checkpoint is None:
            machine = deps.workflow.machine
            initial = AgentState(
                max_steps=_UNBOUNDED_STEPS,
                machine=machine.start() if machine is not None else None,
                runtime=SessionRuntime(tenant_id=deps.tenant_id, user_id=ids[2]),
            )
            checkpoint = await deps.state.acreate(key, initial, good=True)
        check_owner(checkpoint.state, ids[2], deps.tenant_id)
        return checkpoint.state, checkpoint.version

    async def _message(self, message: _Message, loaded: Loaded) -> tuple[AgentReply, Loaded]:
        """A message on a session not parked (or whose parked turn went on): a retry of a
        turn answered once, an open turn finished first, then the message's own turn."""
        deps, lease, ids, text = message.deps, message.lease, message.ids, message.text
        emit, extras = message.emit, message.extras
        state = loaded[0]
        runtime = state.runtime
        masking = deps.masking
        turn_id = extras.turn_id if extras is not None else None
        masked = ""
        if turn_id is not None:
            masked = await masking.amask(storable(text))
            replayed = recorded_reply(state, turn_id, masked)
            if replayed is not None:
                shown = await masking.areveal(replayed.text)
                return replayed.model_copy(update={"text": shown}), loaded
            if runtime.open_turn == turn_id:
                if open_turn_text(state) != masked:
                    raise UsageError(f"turn id {turn_id!r} was used for another message")
                # The caller's retry of a turn a crash left open: finish it, once.
                return await self._turn(deps, lease, ids, loaded, None, emit)
        interrupted: AgentReply | None = None
        if runtime.open_turn is not None:
            open_text = open_turn_text(state)
            interrupted, loaded = await self._turn(deps, lease, ids, loaded, None)
            if open_text is not None and open_text == await masking.amask(storable(text)):
                return interrupted, loaded
        earlier: AgentReply | None = None
        if turn_id is not None:
            # The id is claimed for this message before anything runs under it (see _reply).
            store = deps.state
            earlier = await claimed_turn(deps.journal, store, ids[0], loaded, turn_id, masked)
        if earlier is not None:
            reply = earlier.model_copy(update={"text": await masking.areveal(earlier.text)})
        else:
            reply, loaded = await self._turn(deps, lease, ids, loaded, text, emit, extras)
        if interrupted is not None:
            reply = reply.model_copy(update={"interrupted_turn": interrupted})
        return reply, loaded

    async def _answer_parked(self, message: _Message, loaded: Loaded) -> AgentReply:
        """A message on a parked session. Parked on the user's confirmation: the model reads
        the message and may record the answer (``decide_approval``, accepted only before any
        tool result enters the turn: see `keel.runtime._approvals`); once everything is
        decided the turn goes on. Parked on an operator only: it stays parked, the reply says
        so, the model is not asked. Everything decided: the turn goes on, then the message
        is answered."""
        deps, lease, ids = message.deps, message.lease, message.ids
        requests = await self._awaited(loaded[0])
        pending = [request for request in requests if request.status == "pending"]
        if pending and not any(request.kind == "user" for request in pending):
            waiting = waiting_text(pending, self.deps.workflow.domain_tools.get)
            return _standing(ids[1], loaded[1], requests, waiting)
        if pending:
            reply, loaded = await self._message(message, loaded)
            requests = await self._awaited(loaded[0])
            if any(request.status == "pending" for request in requests):
                # The answer decided nothing (or not all): still parked.
                views = tuple(pending_view(request) for request in requests)
                return reply.model_copy(update={"status": "awaiting_approval", "approvals": views})
            if not requests:
                return reply
            return (await self._turn(deps, lease, ids, loaded, None))[0]
        went_on, loaded = await self._turn(deps, lease, ids, loaded, None)
        reply, _ = await self._message(message, loaded)
        return reply.model_copy(update={"interrupted_turn": went_on})

    async def _awaited(self, state: AgentState) -> list[ApprovalRequest]:
        """The requests the session waits for, as they stand now (overdue ones expired)."""
        config = _config(self.deps)
        tenant_id = self.deps.tenant_id

        async def read() -> list[ApprovalRequest]:
            found = [await config.store.aget(tenant_id, i) for i in state.runtime.awaiting]
            return [request for request in found if request is not None]

        requests = await read()
        if await _expire_overdue(config, requests):
            requests = await read()
        return requests

    # --- resume, decide, carry out, revert --------------------------------------------------

    async def resume(self, session_id: str, user_id: str) -> AgentReply | None:
        """``Agent.resume``: a turn a crash left open is finished; a parked one goes on when
        every request it waits for is decided; None when there is nothing to finish."""
        require_id("session_id", session_id)
        require_id("user_id", user_id)
        key = self.key(session_id)
        async with self.own(key) as lease:
            ids = (key, session_id, user_id)
            checkpoint = await self.deps.state.apeek(key)
            if checkpoint is None:
                return None
            check_owner(checkpoint.state, user_id, self.deps.tenant_id)
            loaded = (checkpoint.state, checkpoint.version)
            deps = self.deps.for_user(user_id)
            if checkpoint.state.runtime.awaiting and deps.approvals:
                return await self._go_on(deps, lease, ids, loaded)
            if checkpoint.state.runtime.open_turn is None:
                return None
            return (await self._turn(deps, lease, ids, loaded, None))[0]

    async def _go_on(
        self,
        deps: TurnDeps,
        lease: Lease,
        ids: tuple[str, str, str],
        loaded: Loaded,
        approval_id: str | None = None,
        *,
        reveal: bool = True,
    ) -> AgentReply:
        """The parked session goes on once every request it waits for is decided; else a reply
        saying what it still waits for (``approval_id``: the request just decided; ``reveal``:
        False gives the resumed turn's reply as stored, see `RunExtras`)."""
        extras = RunExtras(reveal=reveal)
        state, version = loaded
        if approval_id is not None and approval_id not in state.runtime.awaiting:
            if state.runtime.open_turn is not None:
                # A crash came before the turn could park on it: finishing the turn replays
                # its step, which finds the request decided and carries it out.
                return (await self._turn(deps, lease, ids, loaded, None, extras=extras))[0]
            # Decided again, or after its turn went on: nothing more runs.
            request = await _config(self.deps).store.aget(self.deps.tenant_id, approval_id)
            requests = [] if request is None else [request]
            reply = _standing(ids[1], version, requests, f"Approval {approval_id} is settled.")
            return reply.model_copy(update={"replayed": True})
        requests = await self._awaited(state)
        pending = [request for request in requests if request.status == "pending"]
        if pending:
            text = "Waiting for: " + "; ".join(f"{r.tool} ({r.reason})" for r in pending)
            return _standing(ids[1], version, requests, text)
        return (await self._turn(deps, lease, ids, loaded, None, extras=extras))[0]

    async def decide(
        self, session_id: str, approval_id: str, **options: Unpack[DecideOptions]
    ) -> AgentReply:
        """Settle request ``approval_id`` of ``session_id`` and let the session go on: the
        reply of its resumed turn, or one saying what it still waits for (see
        ``Agent.decide``).

        Raises:
            ApprovalSettledError: the request was already settled otherwise (another decision,
                a cancellation, its expiry): this one did not take effect. The same decision
                sent again is no error.
        """
        deps = self.deps
        config = _config(deps)
        request = await config.store.aget(deps.tenant_id, approval_id)
        if request is None or request.session_id != session_id:
            raise AccessDeniedError("there is no such approval request for this session")
        approve = options.get("approve")
        if not isinstance(approve, bool):
            raise UsageError("approve= must be True or False")
        by = _decider(request, options.get("by"), options.get("user_id"))
        reveal = options.get("reveal", True)
        if not isinstance(reveal, bool):
            raise UsageError("reveal= must be True or False")
        # What a decision stores is the request's user's, whoever decides: numbered through
        # their vault, a corrected value is theirs to resolve (per text, <EMAIL_1> is another).
        masking = deps.masking.for_user(request.user_id)
        tools = deps.workflow.domain_tools
        # An agent without the request's tool (``keel ui``'s has none) cannot go on with the
        # turn that asked: it records the decision, as the command line does, and the
        # application's carrier (``carry_out_decisions``, a ``keel serve`` worker) carries it.
        goes_on = bool(tools) and _ours(request, tools)
        check = _corrected if goes_on else _corrected_by_schema
        corrected = await check(deps, masking, request, options.get("arguments"))
        decision = ApprovalDecision(
            approve=approve,
            by=by,
            note=await _masked(masking, options.get("note")),
            arguments=corrected,
            action=options.get("action"),
            decided_at=time.time(),
            channel=options.get("channel", "agent"),
            recorded_only=not goes_on,
            # Bound to exactly what it approves: the corrected arguments, else the request's.
            arguments_digest=arguments_digest(corrected or request.arguments),
        )
        await _expire_overdue(config, [request])
        status: ApprovalStatus = "approved" if approve else "rejected"
        standing, settled = await config.store.adecide(
            deps.tenant_id, approval_id, status, decision
        )
        if not settled and not repeats_standing(standing, decision):
            raise ApprovalSettledError(standing)
        key = self.key(session_id)
        if not goes_on:
            return await _recorded(deps, key, session_id, standing)
        async with self.own(key) as lease:
            ids = (key, session_id, request.user_id)
            checkpoint = await deps.state.aload(key)
            check_owner(checkpoint.state, request.user_id, deps.tenant_id)
            loaded = (checkpoint.state, checkpoint.version)
            deps = deps.for_user(request.user_id)
            return await self._go_on(deps, lease, ids, loaded, approval_id, reveal=reveal)

    async def carry_out(self, user_id: str | None = None) -> list[AgentReply]:
        """``Agent.carry_out_decisions``: every session of the tenant (of ``user_id`` only,
        when given) whose parked turn waits for requests decided elsewhere (``keel approvals
        approve``, another process's ``decide``, an expiry) goes on, once: the replies of the
        turns that went on, the oldest request's session first.

        It reads only the decided requests not yet carried out
        (`ApprovalStore.alist_to_carry_out`: a turn that goes on past a request marks it, see
        ``TurnRunner._settle``), so a pass costs what was decided since, never the tenant's
        whole history. One whose session is not parked on it (reverted, or its turn went on
        without it) is marked here, once that is certain.

        Safe to run in several processes at once: a session goes on under its lease, and its
        state is read again there; a session another process holds is left to it (its turn
        goes on there, or on the next call).
        """
        config = _config(self.deps)
        if not self.deps.workflow.domain_tools:
            # It never parked a turn: one parked on the same database is another application's
            # (``keel ui``'s agent has no tools), whose model and tools must continue it.
            return []
        replies: list[AgentReply] = []
        after: tuple[float, str] | None = None
        while True:
            # The queue marks its overdue requests expired as it lists them.
            page = await config.store.alist_to_carry_out(
                self.deps.tenant_id, user_id=user_id, after=after, limit=CARRY_OUT_PAGE
            )
            replies.extend(await self._carry_out_page(page))
            if len(page) < CARRY_OUT_PAGE:
                return replies
            after = (page[-1].created_at, page[-1].id)

    async def _carry_out_page(self, page: list[ApprovalRequest]) -> list[AgentReply]:
        """The turns parked on ``page``'s requests gone on; what they no longer wait for
        marked."""
        deps = self.deps
        config = _config(deps)
        now = time.time()
        tools = deps.workflow.domain_tools
        sessions: dict[tuple[str, str], list[ApprovalRequest]] = {}
        for request in page:
            if _left_to_carry_out(request, now) and _ours(request, tools):
                sessions.setdefault((request.session_id, request.user_id), []).append(request)
        replies: list[AgentReply] = []
        for (session_id, user_id), requests in sessions.items():
            ids = (self.key(session_id), session_id, user_id)
            checkpoint = await deps.state.apeek(ids[0])
            decided = {request.id for request in requests}
            if not _parked_on(checkpoint, user_id, deps.tenant_id, decided):
                gone = [r.id for r in requests if _gone_past(r, checkpoint, now)]
                if gone:
                    await config.store.amark_carried_out(deps.tenant_id, gone)
                continue
            reply = await self._carry_out_session(ids, decided)
            if reply is not None:
                replies.append(reply)
        return replies

    async def _carry_out_session(
        self, ids: tuple[str, str, str], decided: set[str]
    ) -> AgentReply | None:
        """The reply of the session's parked turn gone on, when it waits for nothing but the
        ``decided`` requests and the like; None when there is nothing to carry out (now)."""
        deps = self.deps
        try:
            async with self.own(ids[0]) as lease:
                # Read again under the lease: another process may have carried it out meanwhile.
                checkpoint = await deps.state.apeek(ids[0])
                if not _parked_on(checkpoint, ids[2], deps.tenant_id, decided):
                    return None
                assert checkpoint is not None
                requests = await self._awaited(checkpoint.state)
                if any(request.status == "pending" for request in requests):
                    return None
                if not all(_ours(request, deps.workflow.domain_tools) for request in requests):
                    return None
                loaded = (checkpoint.state, checkpoint.version)
                deps = deps.for_user(ids[2])
                return (await self._turn(deps, lease, ids, loaded, None, extras=RunExtras()))[0]
        except SessionBusyError:
            return None

    async def revert(
        self, session_id: str, *, expected_version: int, to_version: int
    ) -> Checkpoint[AgentState]:
        """Revert the session to ``to_version`` (compare-and-set on ``expected_version``)
        while holding its lease, as a turn does: a turn running on it makes this
        [`SessionBusyError`][] at once, and nothing changes. A revert of a parked session
        cancels what its turn waited for (recorded with the reason): the state it went back
        to waits for nothing of it."""
        deps, key = self.deps, self.key(session_id)
        lock = deps.state.session_lock(key, ttl=self.lease_ttl_s)
        if not await lock.aacquire():
            raise SessionBusyError(session_id, 0.0)
        try:
            reverted = await deps.state.arevert(
                key, expected_version=expected_version, to_version=to_version
            )
            # The log this process keeps of the session is of a version that is gone.
            self.logs.pop(key, None)
            approvals = deps.approvals
            if approvals is not None and not reverted.state.runtime.awaiting:
                reason = f"the session was reverted (to version {reverted.version})"
                await approvals.store.acancel(deps.tenant_id, session_id, reason)
            return reverted
        finally:
            await lock.arelease()


def check_owner(state: AgentState, user_id: str, tenant_id: str) -> None:
    """Raise unless the session ``state`` is of ``user_id`` in ``tenant_id`` (or names none)."""
    runtime = state.runtime
    if (runtime.user_id is not None and runtime.user_id != user_id) or (
        runtime.tenant_id is not None and runtime.tenant_id != tenant_id
    ):
        raise AccessDeniedError("this session belongs to another user")


def open_turn_text(state: AgentState) -> str | None:
    index = state.runtime.open_turn_message
    if index is None or index >= len(state.messages):
        return None
    return state.messages[index].content


def session_key(tenant_id: str, session_id: str) -> str:
    """The store key of ``session_id`` in ``tenant_id``: ``tenant/session``, the tenant
    percent-encoded so that no tenant and session pair can spell another's key."""
    require_id("tenant_id", tenant_id)
    require_id("session_id", session_id)
    return f"{quote(tenant_id, safe='')}/{session_id}"


def require_id(name: str, value: object) -> None:
    """Raise unless ``value`` is an id: non-empty printable text."""
    if not isinstance(value, str):
        raise UsageError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip() or _LONE_SURROGATE.search(value) or not value.isprintable():
        raise UsageError(f"{name} must be non-empty printable text, got {value!r}")


def user_text(text: object) -> str:
    """``text`` as a user's message, once it is one: text with something visible, no NUL."""
    if not isinstance(text, str):
        raise UsageError(f"the user message must be a string, got {type(text).__name__}")
    # A visible ASCII character settles it in C; only text without one is read per character.
    if _VISIBLE_ASCII.search(text) is None and not any(
        not ch.isspace() and unicodedata.category(ch) not in ("Cf", "Cc") for ch in text
    ):
        raise UsageError("the user message is empty")
    if "\x00" in text:
        # PostgreSQL cannot store a NUL; SQLite could, so both refuse it before a turn starts.
        raise UsageError("the user message holds a NUL character (U+0000)")
    return text


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_VISIBLE_ASCII = re.compile("[!-~]")


def _config(deps: TurnDeps) -> Approvals:
    if deps.approvals is None:
        raise UsageError(
            "this agent has no approval queue (Agent(..., approvals=Approvals(store)))"
        )
    return deps.approvals


def _decider(request: ApprovalRequest, by: object, user_id: object) -> str:
    """Who decides, as the request records it; refused unless they may."""
    if user_id is not None:
        if request.kind != "user" or request.user_id != user_id:
            raise AccessDeniedError("there is no such approval request for this session")
        return f"user:{user_id}"
    if not isinstance(by, str) or not by.strip():
        raise UsageError("by= names the operator who decides (or user_id= the user)")
    return by if by.startswith(("operator:", "user:")) else f"operator:{by}"


async def _masked(masking: Masking, text: object) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise UsageError("note= must be text")
    return await masking.amask(text)


async def _corrected(
    deps: TurnDeps, masking: Masking, request: ApprovalRequest, arguments: object
) -> str | None:
    """The approver's corrected arguments, validated as the model's are (masked, as the
    request's are), or None.

    Raises:
        ToolArgumentsError: they do not fit the tool.
    """
    if arguments is None:
        return None
    found = deps.workflow.domain_tools.get(request.tool or "")
    if found is None or not isinstance(arguments, str):
        raise UsageError("arguments= corrects a tool call's arguments: one JSON object")
    validated = validated_arguments(found, arguments)
    return await masking.amask(maskable_json(validated.model_dump(mode="json")))


async def _corrected_by_schema(
    deps: TurnDeps, masking: Masking, request: ApprovalRequest, arguments: object
) -> str | None:
    """The corrected arguments checked against the schema the request carries (this agent
    lacks the tool), masked as the request's are, or None."""
    if arguments is None:
        return None
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UsageError("arguments= corrects a tool call's arguments: one JSON object")
    check_corrected_arguments(request, value)
    return await masking.amask(maskable_json(value))


async def _recorded(
    deps: TurnDeps, key: str, session_id: str, standing: ApprovalRequest
) -> AgentReply:
    """The reply to a decision this agent only recorded: nothing ran here."""
    checkpoint = await deps.state.apeek(key)
    text = (
        f"Approval {standing.id} is {standing.status}: recorded; the application that asked "
        "for it carries it out."
    )
    return AgentReply(
        text=text,
        status="completed",
        session_id=session_id,
        run_id="",
        state_version=0 if checkpoint is None else checkpoint.version,
        approvals=(pending_view(standing),),
    )


async def _expire_overdue(config: Approvals, requests: list[ApprovalRequest]) -> bool:
    """Mark the pending requests past their expiry expired; whether any was."""
    now = time.time()
    overdue = any(
        r.status == "pending" and r.expires_at is not None and r.expires_at <= now for r in requests
    )
    if overdue:
        await config.store.aexpire(now)
    return overdue


def _standing(
    session_id: str, version: int, requests: list[ApprovalRequest], text: str
) -> AgentReply:
    """A reply that runs nothing: what the session waits for, or what became of a request."""
    waiting = any(request.status == "pending" for request in requests)
    return AgentReply(
        text=text,
        status="awaiting_approval" if waiting else "completed",
        session_id=session_id,
        run_id="",
        state_version=version,
        approvals=tuple(pending_view(request) for request in requests),
    )


def _gone_past(
    request: ApprovalRequest, checkpoint: Checkpoint[AgentState] | None, now: float
) -> bool:
    """Whether the session, found not parked on ``request``, will never park on it: its turn
    went on without it (or was reverted), so no pass need read it again.

    The order this guards: the tool step stores the request, then the turn's checkpoint that
    parks on it (``runtime.awaiting``) commits, after the step's other calls; a decision (the
    command line reads the queue) can come in between, and a pass peeking then finds the
    session not yet parked on it. Marking it then would lose it: the turn parks a moment
    later on a request no pass reads again. So it is left while the turn that asked is still
    open in the checkpoint (the checkpoint before each model call records ``open_turn``, and
    committed before the model asked for the call, so before the request was stored), and
    while its decision is younger than `PARKING_GRACE_S`."""
    if checkpoint is not None and checkpoint.state.runtime.open_turn == request.turn_id:
        return False
    decision = request.decision
    if decision is not None:
        decided_at = decision.decided_at
    else:  # expired: decided by its expiry
        decided_at = request.expires_at if request.expires_at is not None else request.created_at
    return now - decided_at >= PARKING_GRACE_S


def _left_to_carry_out(request: ApprovalRequest, now: float) -> bool:
    """Whether nobody else is about to carry ``request`` out: decided on the command line
    (which only records), expired, or decided elsewhere longer ago than the grace."""
    decision = request.decision
    if decision is None or decision.recorded_only or decision.channel in (None, "cli"):
        return True
    return now - decision.decided_at >= RESUMING_GRACE_S


def _ours(request: ApprovalRequest, tools: Mapping[str, object]) -> bool:
    """Whether this agent can carry ``request`` out: it has the request's tool. Another
    application on the same database (``keel ui``'s agent has no tools) leaves it alone."""
    return request.tool is None or request.tool in tools


def _parked_on(
    checkpoint: Checkpoint[AgentState] | None, user_id: str, tenant_id: str, decided: set[str]
) -> bool:
    """Whether the session is this tenant's and user's, parked on one of ``decided``."""
    if checkpoint is None:
        return False
    runtime = checkpoint.state.runtime
    if runtime.tenant_id not in (None, tenant_id) or runtime.user_id not in (None, user_id):
        return False
    return bool(decided.intersection(runtime.awaiting))
