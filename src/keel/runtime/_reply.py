"""What one turn of an [`Agent`][] produced, and the replies a session keeps for retries: a
turn the caller gave its own id (an HTTP ``Idempotency-Key``) runs once; its reply is committed
with the turn, and a retry gets it back.

The session keeps the newest 16 such replies; the id itself is claimed for good in the tool
journal, beside the turn's decisions (scope ``<session>#<turn id>``, step -1, which no model
step takes), before the turn runs: the claim survives the reply leaving the session and a
revert of the session to before the turn (a step number the turn used can then come round
again, and the journal would hand its decisions and tool results to whatever runs under the
id). Sent later with the same message, the id gets the reply found in the session's history;
with another message it is refused, and nothing of the first turn is replayed."""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import StateError, UsageError
from keel.messages import Message
from keel.runtime._loop_run import LoopStatus
from keel.state import AgentState

if TYPE_CHECKING:
    from keel.state import StateStore
    from keel.tools import ToolJournal

__all__ = [
    "AgentReply",
    "AgentStatus",
    "PendingApproval",
    "claimed_turn",
    "recorded_reply",
    "request_digest",
    "with_reply",
]

_REPLIES_KEPT = 16
"""Replies kept for turns that came with the caller's own turn id (retries come within minutes)."""

_REQUEST_STEP = -1
"""The journal step of a caller's turn id's claim, under the turn's decision scope: below
every model step (they count from 0), so the claim is never taken for a decision."""

_HISTORY_SCANNED = 256
"""Versions after its claim a retry reads for a turn's reply no longer in the session (a turn
writes a checkpoint per model step and its commit a few after its claim)."""

AgentStatus = Literal[LoopStatus, "failed", "escalated"]
"""How a turn ended: ``completed``, a loop status ([`LoopStatus`][], among
them ``awaiting_approval``: parked until a person decides), ``escalated`` (a loop after the
warning or a call in doubt, handed to the operators' queue instead of failing: their answer
resumes it), or ``failed`` (an error the loop does not own: a bug in a hook, a workflow
gate)."""


class PendingApproval(BaseModel):
    """One call of the turn waiting for a person (see ``Agent.decide``)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="The request's id, to decide it with.")
    kind: Literal["user", "operator", "escalation"]
    tool: str | None
    arguments: str = Field(description="The call's arguments (masked).")
    reason: str = Field(description="Why a person must decide (the policy's words).")
    decidable_by: tuple[str, ...] = Field(description="Who may decide: user, operator.")
    expires_at: float | None = Field(description="Epoch seconds; None: never.")
    status: str = Field(description="pending, approved, rejected, expired or cancelled.")


class AgentReply(BaseModel):
    """What one turn produced, for the caller and for dashboards."""

    model_config = ConfigDict(frozen=True)

    text: str = Field(description="The reply for the user (a clean message when it failed).")
    status: AgentStatus = Field(description="How the turn ended: completed, or why it stopped.")
    session_id: str = Field(description="The session.")
    run_id: str = Field(description="The trace's run id (``keel runs show RUN``).")
    state_version: int = Field(description="The state version committed at the end of the turn.")
    workflow_state: str | None = Field(
        default=None, description="The state machine's state after the turn, if there is one."
    )
    steps: int = Field(default=0, description="Model calls made in the turn.")
    max_prompt_tokens: int = Field(default=0, description="Largest prompt sent in the turn.")
    prompt_limit: int = Field(default=0, description="Tokens a prompt may take (window - reserve).")
    loops_detected: int = Field(default=0, description="Loop detections in the turn.")
    tool_calls: tuple[str, ...] = Field(default=(), description="Tools called, in order.")
    effects: tuple[str, ...] = Field(
        default=(),
        description="Side-effecting tools that ran (or may have run) in the turn, in order; "
        "they stay in the history even when the turn failed and the state was reverted.",
    )
    reverted: bool = Field(default=False, description="State went back to the last good version.")
    truncated: bool = Field(
        default=False,
        description="The answer is cut: it kept reaching the token limit and the run's step or "
        "time limit came before it could be continued to its end (``status`` stays "
        '``completed``; an OpenAI-style caller reads it as ``finish_reason: "length"``).',
    )
    resumed: bool = Field(default=False, description="The turn finished one a crash interrupted.")
    replayed: bool = Field(
        default=False,
        description="The reply of a turn committed earlier under the same caller's turn id: "
        "returned again, nothing ran.",
    )
    interrupted_turn: AgentReply | None = Field(
        default=None,
        description="The reply to an earlier message whose turn a crash had left open, finished "
        "before this message was handled.",
    )
    error: str | None = Field(default=None, description="The error, when the turn failed.")
    approvals: tuple[PendingApproval, ...] = Field(
        default=(),
        description="The calls the turn is parked on (``status='awaiting_approval'``).",
    )
    output: Any = Field(
        default=None,
        description="The validated answer when the turn had an ``output_type`` (``text`` is its "
        "JSON, masked; this value is the model's, for the caller only, never stored).",
    )


def request_digest(masked_text: str) -> str:
    """What identifies a turn's request for its retries: its (masked) message."""
    return hashlib.sha256(masked_text.encode()).hexdigest()


def recorded_reply(state: AgentState, turn_id: str, masked_text: str) -> AgentReply | None:
    """The reply committed for turn ``turn_id``, marked ``replayed``; None when none was.

    Raises:
        UsageError: the turn id was used for another message.
    """
    recorded = next((r for r in state.runtime.replies if r.get("turn_id") == turn_id), None)
    if recorded is None:
        return None
    if recorded.get("request") != request_digest(masked_text):
        raise UsageError(f"turn id {turn_id!r} was used for another message")
    replayed = AgentReply.model_validate(recorded["reply"])
    return replayed.model_copy(update={"replayed": True})


def with_reply(state: AgentState, turn_id: str, request: str, reply: AgentReply) -> AgentState:
    """``state`` with ``reply`` recorded for turn ``turn_id`` (whose masked message was
    ``request``): committed in the same write as the turn, so a retry finds exactly that."""
    runtime = state.runtime
    record = {
        "turn_id": turn_id,
        "request": request_digest(request),
        "reply": reply.model_dump(mode="json"),
    }
    kept = [r for r in runtime.replies if r.get("turn_id") != turn_id]
    replies = (*kept, record)[-_REPLIES_KEPT:]
    return state.model_copy(update={"runtime": runtime.model_copy(update={"replies": replies})})


async def claimed_turn(
    journal: ToolJournal,
    store: StateStore[AgentState],
    key: str,
    loaded: tuple[AgentState, int],
    turn_id: str,
    masked_text: str,
) -> AgentReply | None:
    """Claim the caller's ``turn_id`` on the session ``key`` (its state and version
    ``loaded``) for the message ``masked_text``, before the turn runs; None: the message runs
    as a new turn. The id claimed before for the same message, whose turn the session no
    longer holds (its reply left the 16 kept, or a revert went to before it): that turn's
    reply from the session's history, marked ``replayed``; nothing runs.

    Raises:
        UsageError: the id was claimed for another message; or for this one, whose turn took
            steps and whose reply is no longer in the session's history (nothing runs again).
    """
    state, version = loaded
    digest = request_digest(masked_text)
    scope = f"{key}#{turn_id}"  # the turn's own decision scope (`decision_scope`)
    claim = uuid.uuid4().hex
    mine = Message.user(digest, metadata={"claim": claim, "version": version, "step": state.step})
    held = await journal.arecord_decision(scope, _REQUEST_STEP, mine)
    if held.metadata.get("claim") == claim:
        return None
    if held.content != digest:
        raise UsageError(f"turn id {turn_id!r} was used for another message")
    earlier = await _reply_in_history(store, key, turn_id, digest, int(held.metadata["version"]))
    if earlier is not None:
        return earlier
    if await journal.adecision(scope, int(held.metadata["step"])) is None:
        return None  # the first try stopped before its first model step: nothing ran
    raise UsageError(
        f"turn id {turn_id!r} was answered on this session earlier and its reply is no longer "
        "kept: nothing was run again (send a new message under a new turn id)"
    )


async def _reply_in_history(
    store: StateStore[AgentState], key: str, turn_id: str, digest: str, since: int
) -> AgentReply | None:
    """The reply of turn ``turn_id`` (request ``digest``) as the session's history last
    recorded it, read from the versions after ``since`` (its claim's) on; None when none
    does (the history was pruned, or the turn never committed)."""
    versions = sorted(info.version for info in await store.ahistory(key) if info.version > since)
    found: dict[str, Any] | None = None
    for version in versions[:_HISTORY_SCANNED]:
        try:
            runtime = (await store.aat(key, version)).state.runtime
        except StateError:
            continue  # a version pruned since the history was listed
        record = next((r for r in runtime.replies if r.get("turn_id") == turn_id), None)
        if record is not None and record.get("request") == digest:
            found = record
        if found is not None and runtime.open_turn != turn_id and not runtime.awaiting:
            break  # the turn is closed: the reply recorded last is its reply
    if found is None:
        return None
    return AgentReply.model_validate(found["reply"]).model_copy(update={"replayed": True})
