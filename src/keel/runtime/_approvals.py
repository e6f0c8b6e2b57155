"""Approvals inside a turn: a call that waits for a person, the turn parked on it, and the
decided calls carried out (exactly once, through the journal) when the turn goes on.

A tool declares that its calls wait for a decision (``@tool(approval=...)``). When the model
calls one, :class:`TurnApprovals` holds it back before anything is journalled or run: a
request goes to the agent's :class:`~keel.approvals.ApprovalStore` (its id derived from the
call's journal key, so a replayed step finds the same request), the model's history gets a
result saying it waits, and the other calls of the step run. After the step the turn ends,
parked (``awaiting_approval``), its committed state naming the requests it waits for
(``runtime.awaiting``). The model is not asked again until every one is decided; then the
turn goes on (:meth:`TurnApprovals.settle`, before the loop of the next run on the session):
an approved call runs under the journal key the model's call would have had (a crash
anywhere, or the same decision sent twice, never runs it twice), a rejected or expired one is
answered with who decided and why, and the model carries on from there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus, ApprovalStore
from keel.context import runtime_note
from keel.errors import PlaceholderError, ToolArgumentsError, ToolInDoubtError
from keel.messages import Message, ToolCall
from keel.runtime._events import ApprovalDecided, ApprovalRequested
from keel.runtime._reply import PendingApproval
from keel.runtime._steps import LoopResult, LoopRun, call_hook
from keel.tools import (
    Tool,
    ToolContext,
    ToolExecutor,
    ToolRegistry,
    ToolResult,
    avalidated_arguments,
    idempotency_key,
    tool,
)

if TYPE_CHECKING:
    # Only for types: the runner builds this module's objects.
    from keel.runtime._turn import TurnRunner

__all__ = [
    "DECISION_TOOL",
    "Approvals",
    "TurnApprovals",
    "approval_id",
    "decided_text",
    "pending_view",
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


def _waiting_text(requests: list[ApprovalRequest]) -> str:
    """keel's words for the user while the turn is parked."""
    parts = []
    for request in requests:
        what = f"{request.tool} {request.arguments}"
        if request.kind == "user":
            parts.append(f"Please confirm: shall I go ahead with {what}? ({request.reason})")
        else:
            parts.append(
                f"{what} needs an operator's approval ({request.reason}); I'll continue as "
                "soon as it is decided."
            )
    return "\n".join(parts)


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


class TurnApprovals:
    """One turn's approvals: the calls it holds back, and the decided ones it carries out."""

    def __init__(self, runner: TurnRunner) -> None:
        self.runner = runner
        self.config: Approvals | None = runner.deps.approvals
        self.requested: list[ApprovalRequest] = []
        """The requests this turn is parked on, in the order of their calls."""
        self._executor: ToolExecutor | None = None

    @property
    def parked(self) -> bool:
        return bool(self.requested)

    def registry(self, registry: ToolRegistry, new_message: bool) -> ToolRegistry:
        """The turn's tools: with :data:`DECISION_TOOL` when a user's message comes to a
        session that waits for that user's confirmation (the model reads the answer)."""
        if not (new_message and self.config is not None and self.runner.state.runtime.awaiting):
            return registry
        return ToolRegistry([*registry, self._decision_tool()])

    def _decision_tool(self) -> Tool:
        approvals = self

        @tool(name=DECISION_TOOL)
        async def decide_approval(approval_id: str, approve: bool, note: str = "") -> str:
            """Record the user's answer to a confirmation you asked them for: call it when
            their message says yes or no to a call that waits for their confirmation.

            Args:
                approval_id: The approval's id (apr-...), as the waiting call's result says.
                approve: True when the user confirmed, False when they declined.
                note: The user's answer, in a few words.
            """
            return await approvals.decide_as_user(approval_id, approve, note)

        return decide_approval

    async def decide_as_user(self, request_id: str, approve: bool, note: str) -> str:
        """The user's answer, read by the model, as one compare-and-set on the request."""
        runner = self.runner
        assert self.config is not None
        request = await self.config.store.aget(runner.deps.tenant_id, request_id)
        if (
            request is None
            or request.session_id != runner.session_id
            or request.kind != "user"
            or request.user_id != runner.user_id
        ):
            return f"Error: no confirmation {request_id!r} waits for this user's answer here."
        decision = ApprovalDecision(
            approve=approve,
            by=f"user:{runner.user_id}",
            note=await runner.deps.masking.amask(note) or None,
            decided_at=time.time(),
        )
        status: ApprovalStatus = "approved" if approve else "rejected"
        request, settled = await self.config.store.adecide(
            runner.deps.tenant_id, request_id, status, decision
        )
        await self.record_decision(request, f"decided by the user's message: {request.status}")
        if not settled:
            return f"Already settled: the call is {request.status}; nothing changed."
        return f"Recorded: the user {'confirmed' if approve else 'declined'} {request.tool}."

    def executor(self) -> ToolExecutor:
        """The executor decided calls run through: the turn's own tool step's (its journal,
        masking, vault and scope)."""
        if self._executor is None:
            self._executor = self.runner.tool_step(self.runner.deps.guards).executor
        return self._executor

    # --- holding a call back ------------------------------------------------------------------

    async def hold(self, step: int, index: int, call: ToolCall) -> ToolResult | None:
        """The result that holds ``call`` back until a person decides; None: it runs now."""
        runner = self.runner
        found = runner.registry.get(call.name)
        if found is None or found.approval in (None, False):
            return None
        try:
            # With the user's values in place of their placeholders, as the call would run.
            vault = runner.deps.masking.user_vault
            arguments = await avalidated_arguments(found, call.arguments, vault)
        except (ToolArgumentsError, PlaceholderError):
            # The executor refuses the call too and tells the model why: nothing to approve.
            return None
        key = idempotency_key(runner.key, step, index, runner.turn_id)
        context = ToolContext(
            session_id=runner.key,
            step=step,
            call_index=index,
            call_id=call.id,
            idempotency_key=key,
            user_id=runner.user_id,
            tenant_id=runner.deps.tenant_id,
            run_id=runner.trace.run_id,
            deps=runner.tool_deps,
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
        request = await self._request(found, call, step, index, key, arguments.model_dump(), need)
        if request.status != "pending":
            # Decided before the turn parked on it (a crash between the two): carry it out.
            result = await self.carry_out(request)
            status = "blocked" if result is None else result.status
            return _held(call, status, decided_text(request, result))
        self.requested.append(request)
        view = pending_view(request)
        if runner.emit is not None:
            runner.emit(ApprovalRequested(step=step, approval=view))
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
        arguments: dict[str, Any],
        need: Any,
    ) -> ApprovalRequest:
        """The request for the held call: stored, or the one a replayed step stored."""
        assert self.config is not None
        runner, deps = self.runner, self.runner.deps
        now = time.time()
        expires_after = need.expires_after_s or self.config.expires_after_s
        request = ApprovalRequest(
            id=approval_id(key),
            tenant_id=deps.tenant_id,
            user_id=runner.user_id,
            session_id=runner.session_id,
            turn_id=runner.turn_id,
            kind=need.kind,
            tool=found.name,
            call_id=call.id,
            arguments=await deps.masking.amask(json.dumps(arguments, sort_keys=True, default=str)),
            reason=await deps.masking.amask(need.reason),
            step=step,
            created_at=now,
            expires_at=None if expires_after is None else now + expires_after,
            metadata={"call_index": index, "journal_key": key},
        )
        return await self._stored(request)

    async def _stored(self, request: ApprovalRequest) -> ApprovalRequest:
        """``request`` in the queue (or the one a replayed step stored): a new one is traced
        and the deployment told."""
        assert self.config is not None
        stored = await self.config.store.aadd(request)
        if stored.created_at == request.created_at:
            await self.runner.trace.arecord(
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

    async def escalate(self, result: LoopResult) -> bool:
        """Put a turn that stopped (a loop again, a call in doubt) in the operators' queue
        instead of failing it, when the agent escalates that stop; whether it did."""
        runner = self.runner
        if self.config is None or not self.config.escalates(result.status):
            return False
        doubtful = [r for s in result.steps for r in s.tool_results if r.status == "in_doubt"]
        stopped = doubtful[-1] if doubtful else None
        journal_key = (
            stopped.exception.idempotency_key
            if stopped and isinstance(stopped.exception, ToolInDoubtError)
            else None
        )
        key = idempotency_key(runner.key, result.next_step, 0, runner.turn_id)
        masking = runner.deps.masking
        now = time.time()
        request = ApprovalRequest(
            id="esc-" + key.removeprefix("keel-"),
            tenant_id=runner.deps.tenant_id,
            user_id=runner.user_id,
            session_id=runner.session_id,
            turn_id=runner.turn_id,
            kind="escalation",
            tool=None if stopped is None else stopped.tool,
            call_id=None if stopped is None else stopped.call_id,
            arguments="{}" if stopped is None else await masking.amask(stopped.raw_arguments),
            reason=await masking.amask(f"{result.status}: {result.error_message or ''}"),
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
            _waiting_text(self.requested), metadata={"keel_stop": "awaiting_approval"}
        )
        run.history.append(waiting)
        return run.result("awaiting_approval", waiting)

    # --- going on once decided ----------------------------------------------------------------

    async def settle(self) -> None:
        """The parked turn goes on: each decided request carried out or answered, a note
        for the model per request, and the turn open again (a checkpoint before any model
        call), no longer waiting."""
        runner = self.runner
        assert self.config is not None
        masking = runner.deps.masking
        for request_id in runner.state.runtime.awaiting:
            request = await self.config.store.aget(runner.deps.tenant_id, request_id)
            if request is None or request.status == "pending":
                continue
            if request.kind == "escalation":
                text = await masking.amask(await self._answered(request))
            else:
                text = await masking.amask(decided_text(request, await self.carry_out(request)))
            runner.log.append(
                runtime_note(text, reason="approval", metadata={"approval": request.id})
            )
            await self.record_decision(request, text)
        runtime = runner.state.runtime.model_copy(
            update={
                "awaiting": (),
                "open_turn": runner.turn_id,
                "open_turn_message": runner.turn_start,
            }
        )
        await runner.checkpoint({"runtime": runtime}, reason="approvals decided")

    async def _answered(self, request: ApprovalRequest) -> str:
        """What the model is told of an operator's answer to an escalation: the answer, and
        how a call left in doubt was settled (its result, as the operator recorded it)."""
        decision = request.decision
        by = "nobody" if decision is None else decision.by
        note = f": {decision.note}" if decision is not None and decision.note else ""
        key = request.metadata.get("journal_key")
        entry = None if not key else await self.runner.deps.journal.aget(str(key))
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
        runner, decision = self.runner, request.decision
        await runner.trace.arecord(
            "other",
            "approval_decided",
            tool_name=request.tool,
            tool_call_id=request.call_id,
            tool_result=text,
            attributes=_trace_attributes(request),
        )
        if runner.emit is not None:
            runner.emit(
                ApprovalDecided(
                    approval_id=request.id,
                    status=request.status,
                    by=None if decision is None else decision.by,
                    result=text,
                )
            )

    async def carry_out(self, request: ApprovalRequest) -> ToolResult | None:
        """Run an approved call once, under the journal key the model's call had (its
        recorded result when it already ran); None for a request that is not approved."""
        if request.status != "approved" or request.tool is None:
            return None
        decision = request.decision
        arguments = decision.arguments if decision is not None and decision.arguments else None
        call = ToolCall(
            id=request.call_id or request.id,
            name=request.tool,
            arguments=arguments or request.arguments,
        )
        # A worker that stalled past its lease never acts on a session another one took over.
        await self.runner.lease.check()
        return await self.executor().execute(
            call,
            session_id=self.runner.key,
            step=request.step,
            call_index=int(request.metadata.get("call_index", 0)),
            turn_id=request.turn_id,
        )


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
