"""The approval hold: the policy a tool step consults for every call before its executor, a
turn parked on what it holds, and the decided calls carried out (exactly once, through the
journal) when the turn goes on.

A tool declares that its calls wait for a decision (``@tool(approval=...)``). The tool step
(`ToolStep`) owns one `ApprovalHold`, built from the
agent's [`Approvals`][] and the turn's facts (`TurnFacts`: tenant, user, session,
turn, trace, events, masking, the lease check), passed in by whichever drives the loop (the
agent's turn or a [`ToolLoop`][]); the hold never reaches back into its
driver. When the model calls such a tool, the hold keeps it back before anything is journalled
or run: a request goes to the [`ApprovalStore`][] (its id derived from the
call's journal key, so a replayed step finds the same request), the model's history gets a
result saying it waits, and the other calls of the step run. After the step the run ends,
parked (``awaiting_approval``), the turn's committed state naming the requests it waits for
(``runtime.awaiting``). The model is not asked again until every one is decided; then the
turn goes on (`ApprovalHold.settle`, before the loop of the next run on the session):
an approved call runs under the journal key the model's call would have had (a crash
anywhere, or the same decision sent twice, never runs it twice), a rejected or expired one is
answered with who decided and why, and the model carries on from there.

A decision is bound to the arguments it approved (``ApprovalDecision.arguments_digest``, see
[`keel.approvals.arguments_digest`][]): a call is carried out only with exactly those, and a
call whose arguments differ is not run (it needs a decision of its own).

A user's confirmation comes from the user: ``Agent.decide(user_id=...)``, the user's key over
HTTP, the viewer, or the user's own new message read by the model through
`DECISION_TOOL`. That tool is offered only on a user's new message while a confirmation
waits, and the hold accepts its call only while nothing untrusted has entered the turn (no
tool result yet): a fetched page or any other tool's output cannot confirm on the user's
behalf.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel.approvals import (
    ApprovalDecision,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalStore,
    arguments_digest,
)
from keel.context import runtime_note
from keel.errors import PlaceholderError, ToolArgumentsError, ToolInDoubtError
from keel.messages import Message, ToolCall
from keel.privacy import maskable_json
from keel.runtime._events import AgentEvent, ApprovalDecided, ApprovalRequested
from keel.runtime._loop_run import LoopResult, LoopRun, MaybeAwaitable, blocked, call_hook
from keel.runtime._reply import PendingApproval
from keel.tools import (
    Tool,
    ToolExecutor,
    ToolRegistry,
    ToolResult,
    avalidated_arguments,
    idempotency_key,
    tool,
    validated_arguments,
)

if TYPE_CHECKING:
    from keel.tracing import RunTrace

__all__ = [
    "DECISION_TOOL",
    "ApprovalHold",
    "Approvals",
    "TurnFacts",
    "approval_id",
    "decided_text",
    "pending_view",
    "waiting_text",
    "with_decision_tool",
]

ESCALATED_NOTE = " I've handed this to a person; I'll continue as soon as they answer."
"""What the user is told, after keel's stop message, of a turn that escalated."""

_ESCALATING = ("loop_detected", "tool_in_doubt")
"""The stops a turn may escalate instead of failing (``Approvals.escalate``)."""

DECISION_TOOL = "decide_approval"
"""The built-in tool the model records a user's answer to a confirmation with."""

logger = logging.getLogger("keel.runtime")


@dataclass(frozen=True)
class Approvals:
    """An agent's approvals: where requests wait, who is told of a new one, and how long a
    request may wait when its tool's policy does not say.

    Attributes:
        store: the durable queue (``Backends.approvals``, or one of your own).
        on_request: ``(request) -> None``, sync or async, called once per new request (notify
            your own systems: a chat message, a ticket); a failure is logged, never the turn's.
        expires_after_s: how long a request may wait (None: until decided).
        escalate: a turn that loops again after the warning, or leaves a call in doubt,
            goes to the operators' queue (``escalated``, keeping what it learned) instead of
            failing: True for both, or the stops by name (``("tool_in_doubt",)``).
    """

    store: ApprovalStore
    on_request: Callable[[ApprovalRequest], Awaitable[None] | None] | None = None
    expires_after_s: float | None = None
    escalate: bool | tuple[str, ...] = False

    def escalates(self, status: str) -> bool:
        """Whether a turn that stopped with ``status`` escalates."""
        chosen = _ESCALATING if self.escalate is True else self.escalate or ()
        return status in chosen and status in _ESCALATING


def approval_id(journal_key: str) -> str:
    """The id of the request for the call journalled under ``journal_key`` (stable across a
    replay of its step: the same call gets the same request)."""
    return "apr-" + journal_key.removeprefix("keel-")


def pending_view(request: ApprovalRequest) -> PendingApproval:
    """What a reply and an event show of ``request``."""
    return PendingApproval(
        id=request.id,
        kind=request.kind,
        tool=request.tool,
        arguments=request.arguments,
        reason=request.reason,
        decidable_by=request.decidable_by(),
        expires_at=request.expires_at,
        status=request.status,
    )


WAITING_FOR_OPERATOR = (
    "I need a colleague to approve this before I go on; I'll continue as soon as it's decided."
)
"""What a customer reads while a call waits for an operator (a tool's ``waiting_message``
replaces it); the operator's detail (tool, arguments, reason) stays in the request."""


def waiting_text(
    requests: Sequence[ApprovalRequest], tool_named: Callable[[str], Tool | None]
) -> str:
    """keel's words for the customer while the turn is parked on ``requests``: each tool's
    own ``waiting_message``, else a sentence written for a customer (no JSON, no tool name);
    the same words once."""
    parts: list[str] = []
    for request in requests:
        found = tool_named(request.tool) if request.tool else None
        if found is not None and found.waiting_message:
            text = found.waiting_message
        elif request.kind == "user":
            text = f"Please confirm: shall I {_in_words(request)}?"
        else:
            text = WAITING_FOR_OPERATOR
        if text not in parts:
            parts.append(text)
    return "\n".join(parts)


def _in_words(request: ApprovalRequest) -> str:
    """A call as a person reads it: ``cancel (order: 1024)``."""
    what = (request.tool or "go on").replace("_", " ")
    try:
        arguments = json.loads(request.arguments)
    except json.JSONDecodeError:
        return what
    if not isinstance(arguments, dict) or not arguments:
        return what
    return f"{what} ({', '.join(f'{name}: {value}' for name, value in arguments.items())})"


def decided_text(request: ApprovalRequest, result: ToolResult | None) -> str:
    """What the model is told of a decided request (``result``: the approved call's)."""
    decision = request.decision
    by = decision.by if decision is not None else None
    why = f" ({decision.note})" if decision is not None and decision.note else ""
    what = f"The call {request.tool} {request.arguments} (approval {request.id})"
    if request.status == "approved" and result is not None:
        corrected = (
            f" with corrected arguments {decision.arguments}"
            if decision is not None and decision.arguments
            else ""
        )
        ran = "it ran" if result.ok else "its outcome"
        return f"{what} was approved by {by}{why}; {ran}{corrected}: {result.content}"
    if request.status == "rejected":
        return f"{what} was rejected by {by}{why}. It was not run; do not call it again."
    if request.status == "expired":
        return f"{what} expired without a decision, which counts as rejected. It was not run."
    return f"{what} was cancelled ({request.status_reason or 'no reason given'}). Not run."


@dataclass(frozen=True)
class TurnFacts:
    """What an `ApprovalHold` knows of the turn (or run) it holds calls for, given by
    whichever drives the loop.

    Attributes:
        key: the session's store key: the journal's and the tool contexts' session.
        session_id: the session as requests name it.
        user_id / tenant_id: whose turn it is.
        turn_id: the turn the calls belong to (None: a loop run outside a turn).
        mask: masks what the hold stores or shows (a request's arguments, reason and notes;
            None: kept as written).
        trace: the turn's run in the trace store (None: not traced).
        emit: where the turn's events go (None: not streamed).
        before_side_effect: ``(call) -> None``, right before a decided call runs: the agent
            checks its lease on the session here.
        confirmations: whether a user's message in this turn may confirm a waiting call
            through `DECISION_TOOL` (offered only then).
    """

    key: str
    session_id: str
    user_id: str
    tenant_id: str
    turn_id: str | None = None
    mask: Callable[[str], Awaitable[str]] | None = None
    trace: RunTrace | None = None
    emit: Callable[[AgentEvent], None] | None = None
    before_side_effect: Callable[[ToolCall], MaybeAwaitable[None]] | None = None
    confirmations: bool = False

    async def masked(self, text: str) -> str:
        """``text`` as the hold may store or show it."""
        return text if self.mask is None else await self.mask(text)


@tool(name=DECISION_TOOL)
def _decision_tool(approval_id: str, approve: bool, note: str = "") -> str:
    """Record the user's answer to a confirmation you asked them for: call it when their
    message says yes or no to a call that waits for their confirmation.

    Args:
        approval_id: The approval's id (apr-...), as the waiting call's result says.
        approve: True when the user confirmed, False when they declined.
        note: The user's answer, in a few words.
    """
    # The hold answers every call of this tool before the executor: reaching here means a
    # path went around it, and nothing is decided.
    return "Error: not recorded (a confirmation is recorded only through the approval hold)."


def with_decision_tool(registry: ToolRegistry, offered: bool) -> ToolRegistry:
    """``registry``, with `DECISION_TOOL` when ``offered`` (a user's new message comes
    to a session that waits for a confirmation: the model reads the answer)."""
    return ToolRegistry([*registry, _decision_tool]) if offered else registry


class ApprovalHold:
    """The approval policy of one turn's tool step (see the module docstring).

    Args:
        config: the agent's approvals (None: a call that needs one is refused, not run).
        facts: the turn's facts.
        executor: the tool step's executor: it builds a call's context and journal key, and
            runs the decided calls.
    """

    def __init__(self, config: Approvals | None, facts: TurnFacts, executor: ToolExecutor) -> None:
        self.config = config
        self.facts = facts
        self.executor = executor
        self.requested: list[ApprovalRequest] = []
        """The requests this turn is parked on, in the order of their calls."""
        self.settled: list[str] = []
        """The decided requests `settle` carried out or answered (to mark once the turn's
        checkpoint no longer waits for them: `mark_carried_out`)."""

    @property
    def parked(self) -> bool:
        return bool(self.requested)

    # --- holding a call back ------------------------------------------------------------------

    async def consult(self, run: LoopRun, index: int, call: ToolCall) -> ToolResult | None:
        """The result that holds ``call`` back (it waits for a person, or is refused); None:
        it runs now."""
        found = self.executor.registry.get(call.name)
        if found is _decision_tool:
            return await self._confirmation(run, call)
        if found is None or found.approval in (None, False):
            return None
        try:
            # With the user's values in place of their placeholders, as the call would run.
            arguments = await avalidated_arguments(found, call.arguments, self.executor.vault)
        except (ToolArgumentsError, PlaceholderError):
            # The executor refuses the call too and tells the model why: nothing to approve.
            return None
        facts = self.facts
        context = self.executor.call_context(
            call, session_id=facts.key, step=run.step, call_index=index, turn_id=facts.turn_id
        )
        need = found.approval_need(arguments, context)
        if need is None:
            return None
        if self.config is None:
            return _held(
                call,
                "blocked",
                f"Error: {call.name} needs a person's approval and this agent has no approval "
                "queue, so it was not run.",
            )
        masked = await facts.masked(maskable_json(arguments.model_dump()))
        request = await self._request(
            found, call, run.step, index, context.idempotency_key, masked, need
        )
        if request.status != "pending":
            # Decided before the run parked on it (a crash between the two): carry it out, if
            # this call is the one that was decided. No checkpoint waits for it: the turn goes
            # on past it here.
            result = await self.carry_out(request, asked=masked)
            status = "blocked" if result is None else result.status
            await self.mark_carried_out([request.id])
            return _held(call, status, decided_text(request, result))
        self.requested.append(request)
        view = pending_view(request)
        if facts.emit is not None:
            facts.emit(ApprovalRequested(step=run.step, approval=view))
        return _held(
            call,
            "awaiting_approval",
            f"Not run yet: this call waits for a decision ({view.reason}; approval {request.id}, "
            f"decided by: {', '.join(view.decidable_by)}). Do not call it again: its outcome "
            "will follow once it is decided.",
        )

    async def _request(
        self,
        found: Tool,
        call: ToolCall,
        step: int,
        index: int,
        key: str,
        arguments: str,
        need: Any,
    ) -> ApprovalRequest:
        """The request for the held call (``arguments``: masked): stored, or the one a
        replayed step stored."""
        assert self.config is not None
        facts = self.facts
        now = time.time()
        expires_after = need.expires_after_s or self.config.expires_after_s
        request = ApprovalRequest(
            id=approval_id(key),
            tenant_id=facts.tenant_id,
            user_id=facts.user_id,
            session_id=facts.session_id,
            turn_id=facts.turn_id or "",
            kind=need.kind,
            tool=found.name,
            call_id=call.id,
            arguments=arguments,
            reason=await facts.masked(need.reason),
            step=step,
            created_at=now,
            expires_at=None if expires_after is None else now + expires_after,
            metadata={"call_index": index, "journal_key": key},
            arguments_schema=found.parameters_schema(),
        )
        return await self._stored(request)

    async def _stored(self, request: ApprovalRequest) -> ApprovalRequest:
        """``request`` in the queue (or the one a replayed step stored): a new one is traced
        and the deployment told."""
        assert self.config is not None
        stored = await self.config.store.aadd(request)
        if stored.created_at == request.created_at:
            if self.facts.trace is not None:
                await self.facts.trace.arecord(
                    "other",
                    "approval_requested",
                    tool_name=stored.tool,
                    tool_call_id=stored.call_id,
                    tool_arguments=stored.arguments,
                    attributes=_trace_attributes(stored),
                )
            if self.config.on_request is not None:
                await _notify(self.config.on_request, stored)
        return stored

    # --- the user's words, read by the model --------------------------------------------------

    async def _confirmation(self, run: LoopRun, call: ToolCall) -> ToolResult:
        """A call of `DECISION_TOOL`: recorded as the user's answer only while nothing
        untrusted has entered the turn (see the module docstring)."""
        if any(message.role == "tool" for message in run.history.added):
            return blocked(
                call,
                f"Error: {DECISION_TOOL} was refused: a confirmation is taken only from the "
                "user's own message, before any tool result entered this turn, and one has. "
                "Nothing was decided; ask the user to confirm in a message of their own.",
            )
        try:
            answer = validated_arguments(_decision_tool, call.arguments).model_dump()
        except ToolArgumentsError as exc:
            return blocked(call, f"Error: invalid arguments for {DECISION_TOOL}: {exc}")
        text = await self.decide_as_user(
            str(answer["approval_id"]), bool(answer["approve"]), str(answer["note"])
        )
        return _held(call, "blocked" if text.startswith("Error") else "ok", text)

    async def decide_as_user(self, request_id: str, approve: bool, note: str) -> str:
        """The user's answer, read by the model, as one compare-and-set on the request."""
        facts = self.facts
        if self.config is None or not facts.confirmations:
            return f"Error: no confirmation {request_id!r} waits for this user's answer here."
        request = await self.config.store.aget(facts.tenant_id, request_id)
        if (
            request is None
            or request.session_id != facts.session_id
            or request.kind != "user"
            or request.user_id != facts.user_id
        ):
            return f"Error: no confirmation {request_id!r} waits for this user's answer here."
        decision = ApprovalDecision(
            approve=approve,
            by=f"user:{facts.user_id}",
            note=await facts.masked(note) or None,
            decided_at=time.time(),
            channel="conversation",
            arguments_digest=arguments_digest(request.arguments),
        )
        status: ApprovalStatus = "approved" if approve else "rejected"
        request, settled = await self.config.store.adecide(
            facts.tenant_id, request_id, status, decision
        )
        await self.record_decision(request, f"decided by the user's message: {request.status}")
        if not settled:
            return f"Already settled: the call is {request.status}; nothing changed."
        return f"Recorded: the user {'confirmed' if approve else 'declined'} {request.tool}."

    # --- a stopped or parked run --------------------------------------------------------------

    async def escalate(self, result: LoopResult) -> bool:
        """Put a turn that stopped (a loop again, a call in doubt) in the operators' queue
        instead of failing it, when the agent escalates that stop; whether it did."""
        if self.config is None or not self.config.escalates(result.status):
            return False
        facts = self.facts
        doubtful = [r for s in result.steps for r in s.tool_results if r.status == "in_doubt"]
        stopped = doubtful[-1] if doubtful else None
        journal_key = (
            stopped.exception.idempotency_key
            if stopped and isinstance(stopped.exception, ToolInDoubtError)
            else None
        )
        key = idempotency_key(facts.key, result.next_step, 0, facts.turn_id)
        now = time.time()
        request = ApprovalRequest(
            id="esc-" + key.removeprefix("keel-"),
            tenant_id=facts.tenant_id,
            user_id=facts.user_id,
            session_id=facts.session_id,
            turn_id=facts.turn_id or "",
            kind="escalation",
            tool=None if stopped is None else stopped.tool,
            call_id=None if stopped is None else stopped.call_id,
            arguments="{}" if stopped is None else await facts.masked(stopped.raw_arguments),
            reason=await facts.masked(f"{result.status}: {result.error_message or ''}"),
            step=result.next_step,
            created_at=now,
            expires_at=None,
            metadata={"stop": result.status, "journal_key": journal_key},
        )
        self.requested.append(await self._stored(request))
        return True

    def park(self, run: LoopRun) -> LoopResult:
        """The result of a run parked after its step: keel's waiting message as its answer."""
        waiting = Message.assistant(
            waiting_text(self.requested, self.executor.registry.get),
            metadata={"keel_stop": "awaiting_approval"},
        )
        run.history.append(waiting)
        return run.result("awaiting_approval", waiting)

    # --- going on once decided ----------------------------------------------------------------

    async def settle(self, awaiting: Sequence[str]) -> list[Message]:
        """The parked turn goes on: each decided request of ``awaiting`` carried out or
        answered; keel's note for the model per request (the driver adds them to the turn)."""
        assert self.config is not None
        mask = self.facts.masked
        notes: list[Message] = []
        for request_id in awaiting:
            request = await self.config.store.aget(self.facts.tenant_id, request_id)
            if request is None or request.status == "pending":
                continue
            if request.kind == "escalation":
                text = await mask(await self._answered(request))
            else:
                text = await mask(decided_text(request, await self.carry_out(request)))
            notes.append(runtime_note(text, reason="approval", metadata={"approval": request.id}))
            await self.record_decision(request, text)
            self.settled.append(request.id)
        return notes

    async def mark_carried_out(self, request_ids: Sequence[str]) -> None:
        """Record that the turn went on past ``request_ids`` (carriers stop reading them).
        A failure is logged, never the turn's: a carrier's pass marks them later, finding the
        session no longer parked on them."""
        if self.config is None or not request_ids:
            return
        try:
            await self.config.store.amark_carried_out(self.facts.tenant_id, request_ids)
        except Exception:
            logger.exception("marking approvals %s carried out failed", list(request_ids))

    async def _answered(self, request: ApprovalRequest) -> str:
        """What the model is told of an operator's answer to an escalation: the answer, and
        how a call left in doubt was settled (its result, as the operator recorded it)."""
        decision = request.decision
        by = "nobody" if decision is None else decision.by
        note = f": {decision.note}" if decision is not None and decision.note else ""
        key = request.metadata.get("journal_key")
        entry = None if not key else await self.executor.journal.aget(str(key))
        settled = ""
        if entry is not None and not entry.in_doubt:
            happened = "it took effect" if entry.ok else "it did not take effect"
            settled = f" The call {entry.tool} was checked: {happened} ({entry.content})."
        stop = request.metadata.get("stop", "a stop")
        if request.status != "approved" or decision is None:
            what = f"was closed ({request.status}) by {by}{note}"
        elif decision.action == "skip":
            what = f"was answered by {by}: skip the stopped step and go on without it{note}"
        elif decision.action == "answer":
            what = f"was answered by {by}{note}"
        else:
            what = f"was answered by {by}: try again{note}"
        return f"The turn stopped ({stop}) and went to an operator; it {what}.{settled}"

    async def record_decision(self, request: ApprovalRequest, text: str) -> None:
        """The decision in the trace (who, when, what changed) and in the stream."""
        facts, decision = self.facts, request.decision
        if facts.trace is not None:
            await facts.trace.arecord(
                "other",
                "approval_decided",
                tool_name=request.tool,
                tool_call_id=request.call_id,
                tool_result=text,
                attributes=_trace_attributes(request),
            )
        if facts.emit is not None:
            facts.emit(
                ApprovalDecided(
                    approval_id=request.id,
                    status=request.status,
                    by=None if decision is None else decision.by,
                    result=text,
                )
            )

    async def carry_out(
        self, request: ApprovalRequest, *, asked: str | None = None
    ) -> ToolResult | None:
        """Run an approved call once, under the journal key the model's call had (its
        recorded result when it already ran), with exactly the arguments the decision
        approved; None for a request that is not approved. ``asked``: the masked arguments
        of the model's call found decided (a replayed step), which must be the request's.

        A decision bound to other arguments than those about to run (its digest differs)
        runs nothing: the result says a new decision is needed."""
        if request.status != "approved" or request.tool is None:
            return None
        decision = request.decision
        arguments = decision.arguments if decision is not None and decision.arguments else None
        call = ToolCall(
            id=request.call_id or request.id,
            name=request.tool,
            arguments=arguments or request.arguments,
        )
        unbound = _unbound(request, call.arguments, asked)
        if unbound is not None:
            logger.warning("approval %s not carried out: %s", request.id, unbound)
            return blocked(
                call,
                f"Error: not run: {unbound}. A call with these arguments needs a new decision.",
            )
        # A worker that stalled past its lease never acts on a session another one took over.
        await call_hook(self.facts.before_side_effect, call)
        return await self.executor.execute(
            call,
            session_id=self.facts.key,
            step=request.step,
            call_index=int(request.metadata.get("call_index", 0)),
            turn_id=request.turn_id or None,
        )


def _unbound(request: ApprovalRequest, running: str, asked: str | None) -> str | None:
    """Why ``running`` (the arguments about to run) is not what ``request``'s decision
    approved, or None when it is. A decision recorded without a digest (before decisions were
    bound) approved the request as stored."""
    decision = request.decision
    if asked is not None and arguments_digest(asked) != arguments_digest(request.arguments):
        return f"the call's arguments are not those of approval {request.id}"
    if decision is None or decision.arguments_digest is None:
        return None
    if arguments_digest(running) != decision.arguments_digest:
        return f"approval {request.id} approved other arguments than these"
    return None


def _held(call: ToolCall, status: Any, content: str) -> ToolResult:
    return ToolResult(
        call_id=call.id,
        tool=call.name,
        status=status,
        content=content,
        raw_arguments=call.arguments,
    )


def _trace_attributes(request: ApprovalRequest) -> dict[str, Any]:
    """Who asked, who decided, when, and what changed: for the trace."""
    decision = request.decision
    return {
        "approval_id": request.id,
        "kind": request.kind,
        "status": request.status,
        "reason": request.reason,
        "expires_at": request.expires_at,
        "decided_by": None if decision is None else decision.by,
        "decided_at": None if decision is None else decision.decided_at,
        "note": None if decision is None else decision.note,
        "corrected_arguments": None if decision is None else decision.arguments,
    }


async def _notify(hook: Callable[[ApprovalRequest], Any], request: ApprovalRequest) -> None:
    try:
        await call_hook(hook, request)
    except Exception:
        # The deployment's notification failing never fails the turn: the request is stored.
        logger.exception("on_approval_request failed for %s", request.id)
