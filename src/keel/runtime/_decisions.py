"""Deciding a waiting call, and a session parked on one: ``Agent.decide`` and what a new
message or ``Agent.resume`` finds on a parked session (see `keel.runtime._approvals`).

A decision is one compare-and-set in the approval store (``adecide`` on a pending request):
two deciders at once, or the same decision sent twice, settle it once. Whoever settled it,
the session then goes on under its lease: when every request it waits for is decided, its
turn resumes (the approved calls run once, through the journal); until then, nothing runs.
Only the tenant's operators decide (the agent is the tenant's), and for a confirmation the
session's own user too: anyone else gets [`AccessDeniedError`][], as for a
request that does not exist, so nothing tells them it does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Literal, TypedDict, Unpack

from keel.approvals import (
    ApprovalDecision,
    ApprovalRequest,
    ApprovalStatus,
    Channel,
    arguments_digest,
    check_corrected_arguments,
    repeats_standing,
)
from keel.errors import AccessDeniedError, ApprovalSettledError, SessionBusyError, UsageError
from keel.runtime._approvals import Approvals, pending_view, waiting_text
from keel.runtime._events import AgentEvent
from keel.runtime._lease import Lease
from keel.runtime._masking import Masking
from keel.runtime._reply import AgentReply
from keel.runtime._session import answer, check_owner, resume_open_turn, run_turn
from keel.runtime._turn import RunExtras, TurnDeps
from keel.state import AgentState, Checkpoint
from keel.tools import validated_arguments

__all__ = [
    "DecideOptions",
    "answer_session",
    "cancel_on_revert",
    "carry_out_decisions",
    "decide",
    "resume_parked",
    "resume_session",
]

Own = Callable[[str], contextlib.AbstractAsyncContextManager[Lease]]
"""Takes a session's lease for a block (the agent's ``_own``)."""

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


async def decide(
    deps: TurnDeps,
    own: Own,
    key: str,
    session_id: str,
    approval_id: str,
    **options: Unpack[DecideOptions],
) -> AgentReply:
    """Settle request ``approval_id`` of ``session_id`` and let the session go on: the reply
    of its resumed turn, or one saying what it still waits for (see ``Agent.decide``).

    Raises:
        ApprovalSettledError: the request was already settled otherwise (another decision,
            a cancellation, its expiry): this one did not take effect. The same decision
            sent again is no error.
    """
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
    # What a decision stores is the request's user's, whoever decides: numbered through their
    # vault, a corrected value is theirs to resolve (per text, <EMAIL_1> is another value).
    masking = deps.masking.for_user(request.user_id)
    tools = deps.workflow.domain_tools
    # An agent without the request's tool (``keel ui``'s has none) cannot go on with the turn
    # that asked: it records the decision, as the command line does, and the application's
    # carrier (``carry_out_decisions``, a ``keel serve`` worker) carries it out.
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
    standing, settled = await config.store.adecide(deps.tenant_id, approval_id, status, decision)
    if not settled and not repeats_standing(standing, decision):
        raise ApprovalSettledError(standing)
    if not goes_on:
        return await _recorded(deps, key, session_id, standing)
    ids = (session_id, request.user_id)
    async with own(key) as lease:
        return await resume_session(deps, lease, key, ids, approval_id, reveal=reveal)


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
    return await masking.amask(json.dumps(validated.model_dump(mode="json"), sort_keys=True))


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
    return await masking.amask(json.dumps(value, sort_keys=True))


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


async def _awaited(deps: TurnDeps, state: AgentState) -> list[ApprovalRequest]:
    """The requests the session waits for, as they stand now (overdue ones expired)."""
    config = _config(deps)
    ids = state.runtime.awaiting

    async def read() -> list[ApprovalRequest]:
        found = [await config.store.aget(deps.tenant_id, request_id) for request_id in ids]
        return [request for request in found if request is not None]

    requests = await read()
    if await _expire_overdue(config, requests):
        requests = await read()
    return requests


def _standing(
    session_id: str,
    checkpoint: Checkpoint[AgentState],
    requests: list[ApprovalRequest],
    text: str,
) -> AgentReply:
    """A reply that runs nothing: what the session waits for, or what became of a request."""
    waiting = any(request.status == "pending" for request in requests)
    return AgentReply(
        text=text,
        status="awaiting_approval" if waiting else "completed",
        session_id=session_id,
        run_id="",
        state_version=checkpoint.version,
        approvals=tuple(pending_view(request) for request in requests),
    )


async def resume_session(
    deps: TurnDeps,
    lease: Lease,
    key: str,
    ids: tuple[str, str],
    approval_id: str | None = None,
    *,
    reveal: bool = True,
) -> AgentReply:
    """The parked session goes on once every request it waits for is decided; else a reply
    saying what it still waits for (``approval_id``: the request just decided; ``reveal``:
    False gives the resumed turn's reply as stored, see `RunExtras`)."""
    extras = RunExtras(reveal=reveal)
    checkpoint = await deps.state.aload(key)
    check_owner(checkpoint.state, ids[1], deps.tenant_id)
    awaiting = checkpoint.state.runtime.awaiting
    if approval_id is not None and approval_id not in awaiting:
        if checkpoint.state.runtime.open_turn is not None:
            # A crash came before the turn could park on it: finishing the turn replays
            # its step, which finds the request decided and carries it out.
            return await run_turn(deps, lease, key, ids, checkpoint, None, extras=extras)
        # Decided again, or after its turn went on: nothing more runs.
        config = _config(deps)
        request = await config.store.aget(deps.tenant_id, approval_id)
        requests = [] if request is None else [request]
        reply = _standing(ids[0], checkpoint, requests, f"Approval {approval_id} is settled.")
        return reply.model_copy(update={"replayed": True})
    requests = await _awaited(deps, checkpoint.state)
    pending = [request for request in requests if request.status == "pending"]
    if pending:
        text = "Waiting for: " + "; ".join(f"{r.tool} ({r.reason})" for r in pending)
        return _standing(ids[0], checkpoint, requests, text)
    return await run_turn(deps, lease, key, ids, checkpoint, None, extras=extras)


async def answer_session(
    deps: TurnDeps,
    lease: Lease,
    key: str,
    ids: tuple[str, str],
    text: str,
    emit: Callable[[AgentEvent], None] | None,
    extras: RunExtras | None,
) -> AgentReply:
    """A user's message on the session. Parked on the user's confirmation: the model reads
    the message and may record the answer (``decide_approval``, accepted only before any tool
    result enters the turn: see `keel.runtime._approvals`); once everything is decided
    the turn goes on. Parked on an operator only: it stays parked, the reply says so, the
    model is not asked. Not parked, or everything decided: the message is answered."""
    checkpoint = await deps.state.apeek(key)
    if checkpoint is None or not checkpoint.state.runtime.awaiting or deps.approvals is None:
        return await answer(deps, lease, key, ids, text, emit, extras)
    check_owner(checkpoint.state, ids[1], deps.tenant_id)
    requests = await _awaited(deps, checkpoint.state)
    pending = [request for request in requests if request.status == "pending"]
    if pending and not any(request.kind == "user" for request in pending):
        waiting = waiting_text(pending, deps.workflow.domain_tools.get)
        return _standing(ids[0], checkpoint, requests, waiting)
    if pending:
        reply = await answer(deps, lease, key, ids, text, emit, extras)
        checkpoint = await deps.state.aload(key)
        requests = await _awaited(deps, checkpoint.state)
        if any(request.status == "pending" for request in requests):
            # The answer decided nothing (or not all): still parked.
            views = tuple(pending_view(request) for request in requests)
            return reply.model_copy(update={"status": "awaiting_approval", "approvals": views})
        if not requests:
            return reply
        return await run_turn(deps, lease, key, ids, checkpoint, None)
    went_on = await run_turn(deps, lease, key, ids, checkpoint, None)
    reply = await answer(deps, lease, key, ids, text, emit, extras)
    return reply.model_copy(update={"interrupted_turn": went_on})


async def resume_parked(
    deps: TurnDeps, lease: Lease, key: str, ids: tuple[str, str]
) -> AgentReply | None:
    """``Agent.resume``: a turn a crash left open is finished; a parked one goes on when
    every request it waits for is decided; None when there is nothing to finish."""
    checkpoint = await deps.state.apeek(key)
    if checkpoint is not None and checkpoint.state.runtime.awaiting and deps.approvals:
        return await resume_session(deps, lease, key, ids)
    return await resume_open_turn(deps, lease, key, ids)


async def cancel_on_revert(
    approvals: Approvals | None,
    tenant_id: str,
    session_id: str,
    reverted: Checkpoint[AgentState],
) -> int:
    """A revert of a parked session cancels what its turn waited for (recorded with the
    reason): the state it went back to waits for nothing of it. How many were cancelled."""
    if approvals is None or reverted.state.runtime.awaiting:
        return 0
    reason = f"the session was reverted (to version {reverted.version})"
    return await approvals.store.acancel(tenant_id, session_id, reason)


async def carry_out_decisions(
    deps: TurnDeps, own: Own, key_of: Callable[[str], str], user_id: str | None = None
) -> list[AgentReply]:
    """``Agent.carry_out_decisions``: every session of the tenant (of ``user_id`` only, when
    given) whose parked turn waits for requests decided elsewhere (``keel approvals
    approve``, another process's ``decide``, an expiry) goes on, once: the replies of the
    turns that went on, the oldest request's session first.

    It reads only the decided requests not yet carried out (`ApprovalStore.alist_to_carry_out`:
    a turn that goes on past a request marks it, see ``TurnRunner._settle``), so a pass costs
    what was decided since, never the tenant's whole history. One whose session is not parked
    on it (reverted, or its turn went on without it) is marked here, once that is certain.

    Safe to run in several processes at once: a session goes on under its lease, and its
    state is read again there; a session another process holds is left to it (its turn
    goes on there, or on the next call).
    """
    config = _config(deps)
    tools = deps.workflow.domain_tools
    if not tools:
        # It never parked a turn: one parked on the same database is another application's
        # (``keel ui``'s agent has no tools), whose model and tools must continue it.
        return []
    replies: list[AgentReply] = []
    after: tuple[float, str] | None = None
    while True:
        # The queue marks its overdue requests expired as it lists them.
        page = await config.store.alist_to_carry_out(
            deps.tenant_id, user_id=user_id, after=after, limit=CARRY_OUT_PAGE
        )
        replies.extend(await _carry_out_page(deps, own, key_of, page))
        if len(page) < CARRY_OUT_PAGE:
            return replies
        after = (page[-1].created_at, page[-1].id)


async def _carry_out_page(
    deps: TurnDeps, own: Own, key_of: Callable[[str], str], page: list[ApprovalRequest]
) -> list[AgentReply]:
    """The turns parked on ``page``'s requests gone on; what they no longer wait for marked."""
    config = _config(deps)
    now = time.time()
    tools = deps.workflow.domain_tools
    sessions: dict[tuple[str, str], list[ApprovalRequest]] = {}
    for request in page:
        if _left_to_carry_out(request, now) and _ours(request, tools):
            sessions.setdefault((request.session_id, request.user_id), []).append(request)
    replies: list[AgentReply] = []
    for ids, requests in sessions.items():
        key = key_of(ids[0])
        checkpoint = await deps.state.apeek(key)
        decided = {request.id for request in requests}
        if not _parked_on(checkpoint, ids[1], deps.tenant_id, decided):
            gone = [request.id for request in requests if _gone_past(request, checkpoint, now)]
            if gone:
                await config.store.amark_carried_out(deps.tenant_id, gone)
            continue
        reply = await _carry_out(deps, own, key, ids, decided)
        if reply is not None:
            replies.append(reply)
    return replies


async def _carry_out(
    deps: TurnDeps, own: Own, key: str, ids: tuple[str, str], decided: set[str]
) -> AgentReply | None:
    """The reply of the session's parked turn gone on, when it waits for nothing but the
    ``decided`` requests and the like; None when there is nothing to carry out (now)."""
    try:
        async with own(key) as lease:
            # Read again under the lease: another process may have carried it out meanwhile.
            checkpoint = await deps.state.apeek(key)
            if not _parked_on(checkpoint, ids[1], deps.tenant_id, decided):
                return None
            assert checkpoint is not None
            requests = await _awaited(deps, checkpoint.state)
            if any(request.status == "pending" for request in requests):
                return None
            if not all(_ours(request, deps.workflow.domain_tools) for request in requests):
                return None
            return await run_turn(deps, lease, key, ids, checkpoint, None, extras=RunExtras())
    except SessionBusyError:
        return None


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
