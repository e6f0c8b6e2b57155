"""A session's turns, under the lease its caller holds: the session loaded (created on its first
message, refused to another user or tenant), a turn a crash left open finished first, and a
caller's retry of a turn answered once (its recorded reply, or its open turn finished)."""

from __future__ import annotations

from collections.abc import Callable

from keel.errors import AccessDeniedError, UsageError
from keel.runtime._events import AgentEvent
from keel.runtime._lease import Lease
from keel.runtime._replies import recorded_reply
from keel.runtime._reply import AgentReply
from keel.runtime._text import open_turn_text, sanitize
from keel.runtime._turn import RunExtras, TurnDeps, TurnRunner
from keel.state import AgentState, Checkpoint, SessionRuntime

__all__ = ["answer", "check_owner", "resume_open_turn", "run_turn"]

_UNBOUNDED_STEPS = 1_000_000_000
"""AgentState.max_steps for a session: per-run limits live in GuardConfig."""


def check_owner(state: AgentState, user_id: str, tenant_id: str) -> None:
    """Raise unless the session ``state`` is of ``user_id`` in ``tenant_id`` (or names none)."""
    runtime = state.runtime
    if (runtime.user_id is not None and runtime.user_id != user_id) or (
        runtime.tenant_id is not None and runtime.tenant_id != tenant_id
    ):
        raise AccessDeniedError("this session belongs to another user")


async def _load(deps: TurnDeps, key: str, user_id: str) -> Checkpoint[AgentState]:
    # Read, never changed: the turn builds its state with model_copy and its own log.
    checkpoint = await deps.state.apeek(key)
    if checkpoint is None:
        machine = deps.workflow.machine
        initial = AgentState(
            max_steps=_UNBOUNDED_STEPS,
            machine=machine.start() if machine is not None else None,
            runtime=SessionRuntime(tenant_id=deps.tenant_id, user_id=user_id),
        )
        checkpoint = await deps.state.acreate(key, initial, good=True)
    check_owner(checkpoint.state, user_id, deps.tenant_id)
    return checkpoint


async def run_turn(
    deps: TurnDeps,
    lease: Lease,
    key: str,
    ids: tuple[str, str],
    checkpoint: Checkpoint[AgentState],
    text: str | None,
    emit: Callable[[AgentEvent], None] | None = None,
    extras: RunExtras | None = None,
) -> AgentReply:
    session_id, user_id = ids
    # Every way into a turn (a message, a resume, a decision) numbers through its user's vault.
    deps = deps.for_user(user_id)
    if text is not None:
        # The message's new values go to the vault off the event loop; the turn's own mask
        # of it (as it starts) then finds it in the view's memo.
        await deps.masking.amask(sanitize(text))
    try:
        runner = TurnRunner(deps, lease, key, session_id, user_id, checkpoint, text, emit, extras)
        return await runner()
    except BaseException:
        # Whatever stopped the turn, the session's log may hold messages that were never
        # committed: the next turn builds it again from the store.
        deps.logs.pop(key, None)
        raise


async def answer(
    deps: TurnDeps,
    lease: Lease,
    key: str,
    ids: tuple[str, str],
    text: str,
    emit: Callable[[AgentEvent], None] | None,
    extras: RunExtras | None,
) -> AgentReply:
    """The reply to ``text`` from user ``ids[1]`` on session ``ids[0]`` (store key ``key``)."""
    deps = deps.for_user(ids[1])
    checkpoint = await _load(deps, key, ids[1])
    runtime = checkpoint.state.runtime
    turn_id = extras.turn_id if extras is not None else None
    if turn_id is not None:
        masked = await deps.masking.amask(sanitize(text))
        replayed = recorded_reply(checkpoint.state, turn_id, masked)
        if replayed is not None:
            return replayed.model_copy(update={"text": await deps.masking.areveal(replayed.text)})
        if runtime.open_turn == turn_id:
            if open_turn_text(checkpoint.state) != masked:
                raise UsageError(f"turn id {turn_id!r} was used for another message")
            # The caller's retry of a turn a crash left open: finish it, once.
            return await run_turn(deps, lease, key, ids, checkpoint, None, emit)
    interrupted: AgentReply | None = None
    if runtime.open_turn is not None:
        open_text = open_turn_text(checkpoint.state)
        interrupted = await run_turn(deps, lease, key, ids, checkpoint, None)
        if open_text is not None and open_text == await deps.masking.amask(sanitize(text)):
            return interrupted
        checkpoint = await deps.state.aload(key)
    reply = await run_turn(deps, lease, key, ids, checkpoint, text, emit, extras)
    if interrupted is not None:
        reply = reply.model_copy(update={"interrupted_turn": interrupted})
    return reply


async def resume_open_turn(
    deps: TurnDeps, lease: Lease, key: str, ids: tuple[str, str]
) -> AgentReply | None:
    """Finish the turn a crash left open on the session; None when it has none."""
    checkpoint = await deps.state.aget(key)
    if checkpoint is None:
        return None
    check_owner(checkpoint.state, ids[1], deps.tenant_id)
    if checkpoint.state.runtime.open_turn is None:
        return None
    return await run_turn(deps.for_user(ids[1]), lease, key, ids, checkpoint, None)
