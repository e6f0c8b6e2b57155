"""Through the Agent: calls that wait for a person's decision (issue 37). The turn parks with
``awaiting_approval``, the model is not asked again until the decision is in, and then the
approved call runs once (counted from the tool's own effect), a rejected or expired one never.
The queue is the SQLite store ``Agent.open`` opens."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from keel.approvals import ApprovalRequest
from keel.errors import AccessDeniedError, ApprovalSettledError, ToolArgumentsError, UsageError
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.runtime._events import ApprovalRequested, TurnFinished
from keel.service._access import revert_holding_lease
from keel.state import AgentState, MachineState, StateMachine, StateStore, Transition
from keel.stores import SQLiteDatabase, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import ApprovalNeed, ToolContext, tool


@dataclass
class Shop:
    """The world the tools act on: what they did, in order."""

    refunds: list[tuple[str, int]] = field(default_factory=list)
    lookups: list[str] = field(default_factory=list)
    requested: list[ApprovalRequest] = field(default_factory=list)


def _tools(shop: Shop, approval: Any) -> list[Any]:
    @tool
    def look_up(order: str) -> str:
        """Look an order up.

        Args:
            order: The order id.
        """
        shop.lookups.append(order)
        return f"{order}: paid 80 EUR"

    @tool(approval=approval)
    def refund(order: str, amount: int) -> str:
        """Refund part of an order.

        Args:
            order: The order id.
            amount: Euros to refund.
        """
        shop.refunds.append((order, amount))
        return f"refunded {amount} EUR on {order}"

    return [look_up, refund]


def _both(amount: int = 50) -> Message:
    """One step that reads and refunds."""
    return Message.assistant(
        "",
        tool_calls=[
            ToolCall(id="c1", name="look_up", arguments='{"order": "W1"}'),
            ToolCall(
                id="c2", name="refund", arguments=json.dumps({"order": "W1", "amount": amount})
            ),
        ],
    )


def _told(call: ScriptedCall) -> str:
    """What the model was told last (keel's note on the decision), for its answer."""
    notes = [m.content for m in call.messages if m.role == "system" and "runtime note" in m.content]
    return "Told: " + (notes[-1] if notes else "nothing")


@pytest.fixture
def open_agent(tmp_path: Path) -> Iterator[Any]:
    agents: list[Agent] = []

    def build(
        shop: Shop, replies: list[Any], approval: Any = True, extra: Any = (), **options: Any
    ) -> Agent:
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You run a shop.",
            model=ScriptedModel(replies),
            tools=[*_tools(shop, approval), *extra],
            memory=False,
            on_approval_request=shop.requested.append,
            **options,
        )
        agents.append(agent)
        return agent

    yield build
    for agent in agents:
        agent.close()


async def test_an_approved_call_runs_once_after_the_decision(open_agent: Any) -> None:
    shop = Shop()
    model_replies: list[Any] = [_both(), _told]
    agent = open_agent(shop, model_replies)
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    assert parked.status == "awaiting_approval", parked
    [waiting] = parked.approvals
    assert waiting.tool == "refund" and json.loads(waiting.arguments) == {
        "order": "W1",
        "amount": 50,
    }
    assert waiting.decidable_by == ("operator",) and waiting.status == "pending"
    # The read of the same step ran; the refund did not; the queue and the hook have it.
    assert shop.lookups == ["W1"] and shop.refunds == []
    assert [r.id for r in shop.requested] == [waiting.id]
    state = agent.session_state("s1")
    assert state is not None and state.runtime.awaiting == (waiting.id,)
    assert state.runtime.open_turn is None  # parked, not open: no lease held while it waits
    # A new message while it waits: the model is not asked, the reply says what it waits for.
    again = await agent.run("Is it done?", session="s1", user="u1")
    assert again.status == "awaiting_approval" and "colleague" in again.text
    assert len(agent.model.calls) == 1
    decided = await agent.decide("s1", waiting.id, approve=True, by="alice", note="ok by policy")
    assert decided.status == "completed", decided
    assert "approved by operator:alice (ok by policy); it ran: refunded 50 EUR" in decided.text
    assert shop.refunds == [("W1", 50)]
    # The same decision sent again (an HTTP retry): settled, nothing runs again.
    repeat = await agent.decide("s1", waiting.id, approve=True, by="alice", note="ok by policy")
    assert repeat.replayed and shop.refunds == [("W1", 50)]
    # A contrary decision after it (a second operator): refused, the first one stands.
    with pytest.raises(ApprovalSettledError, match="already approved by operator:alice") as late:
        await agent.decide("s1", waiting.id, approve=False, by="bob")
    assert late.value.request.decision is not None and late.value.request.decision.approve
    assert shop.refunds == [("W1", 50)]
    stored = await agent.approvals.store.aget("default", waiting.id)
    assert stored.status == "approved" and stored.decision.by == "operator:alice"
    state = agent.session_state("s1")
    assert state is not None and state.runtime.awaiting == () and state.runtime.open_turn is None


async def test_a_rejected_call_never_runs_and_the_model_hears_who_and_why(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    decided = await agent.decide(
        "s1", parked.approvals[0].id, approve=False, by="bob", note="refunds over 40 need a manager"
    )
    assert decided.status == "completed" and shop.refunds == []
    assert "rejected by operator:bob (refunds over 40 need a manager)" in decided.text


async def test_corrected_arguments_are_validated_and_run_instead(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    approval = parked.approvals[0].id
    with pytest.raises(ToolArgumentsError, match="amount"):
        await agent.decide(
            "s1", approval, approve=True, by="alice", arguments='{"order": "W1", "amount": "lots"}'
        )
    stored = await agent.approvals.store.aget("default", approval)
    assert stored.status == "pending"  # an invalid correction decides nothing
    decided = await agent.decide(
        "s1", approval, approve=True, by="alice", arguments='{"order": "W1", "amount": "30"}'
    )
    assert shop.refunds == [("W1", 30)]
    assert 'with corrected arguments {"amount": 30, "order": "W1"}' in decided.text


async def test_an_expired_request_counts_as_rejected(open_agent: Any) -> None:
    shop = Shop()

    def over_40(arguments: BaseModel, context: ToolContext) -> ApprovalNeed | None:
        if arguments.model_dump()["amount"] <= 40:
            return None
        return ApprovalNeed("operator", "refunds over 40 need approval", expires_after_s=0.05)

    agent = open_agent(shop, [_both(amount=30), "Refunded 30.", _both(), _told], approval=over_40)
    small = await agent.run("Refund 30 on W1.", session="s1", user="u1")
    assert small.status == "completed" and shop.refunds == [("W1", 30)]  # under: no approval
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    [waiting] = parked.approvals
    assert waiting.reason == "refunds over 40 need approval" and waiting.expires_at is not None
    while time.time() <= waiting.expires_at:
        await asyncio.sleep(0.01)
    with pytest.raises(ApprovalSettledError, match="already expired") as late:
        await agent.decide("s1", waiting.id, approve=True, by="alice")
    assert late.value.request.status == "expired"
    # The parked turn goes on when the session is next taken up, told what became of it.
    resumed = await agent.resume("s1", "u1")
    assert resumed is not None and resumed.status == "completed"
    assert "expired without a decision" in resumed.text
    assert shop.refunds == [("W1", 30)]
    stored = await agent.approvals.store.aget("default", waiting.id)
    assert stored.status == "expired"


async def test_only_the_tenant_and_for_a_confirmation_the_user_decide(
    open_agent: Any, tmp_path: Path
) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told], approval="user")
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    [waiting] = parked.approvals
    assert waiting.decidable_by == ("user", "operator") and "confirm" in parked.text
    other_tenant = open_agent(Shop(), [], tenant_id="globex")
    with pytest.raises(AccessDeniedError):
        await other_tenant.decide("s1", waiting.id, approve=True, by="mallory")
    with pytest.raises(AccessDeniedError):
        await agent.decide("s1", waiting.id, approve=True, user_id="u2")
    with pytest.raises(AccessDeniedError):
        await agent.decide("s2", waiting.id, approve=True, by="alice")
    stored = await agent.approvals.store.aget("default", waiting.id)
    assert stored.status == "pending" and shop.refunds == []
    decided = await agent.decide("s1", waiting.id, approve=True, user_id="u1")
    assert "approved by user:u1" in decided.text and shop.refunds == [("W1", 50)]


async def test_an_operator_approval_is_not_the_users_to_give(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    with pytest.raises(AccessDeniedError):
        await agent.decide("s1", parked.approvals[0].id, approve=True, user_id="u1")
    assert shop.refunds == []


def test_two_deciders_at_once_run_the_call_once(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told, _told])
    parked = agent.run_sync("Refund 50 on W1.", session="s1", user="u1")
    approval = parked.approvals[0].id
    barrier = threading.Barrier(2)
    replies: list[Any] = []

    def decide(by: str) -> None:
        barrier.wait()
        try:
            replies.append(agent.decide_sync("s1", approval, approve=True, by=by))
        except ApprovalSettledError as exc:
            replies.append(exc)  # the loser: another operator's approval stands

    threads = [threading.Thread(target=decide, args=(name,)) for name in ("alice", "bob")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(replies) == 2 and shop.refunds == [("W1", 50)]
    (lost,) = [reply for reply in replies if isinstance(reply, ApprovalSettledError)]
    (won,) = [reply for reply in replies if not isinstance(reply, ApprovalSettledError)]
    assert won.status == "completed" and lost.request.status == "approved"


async def test_the_stream_says_a_call_waits(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    events = [e async for e in agent.stream("Refund 50 on W1.", session="s1", user="u1")]
    [requested] = [e for e in events if isinstance(e, ApprovalRequested)]
    assert requested.approval.tool == "refund"
    assert isinstance(events[-1], TurnFinished)
    assert events[-1].reply.status == "awaiting_approval"


def _confirming(call: ScriptedCall) -> Message | str:
    """A model that turns the user's yes or no into the decision tool's call."""
    last = call.messages[-1]
    if last.role == "user" and last.content in ("yes", "no"):
        waiting = [m.content for m in call.messages if m.role == "tool" and "apr-" in m.content]
        approval = waiting[-1].split("approval ")[1].split(",")[0]
        arguments = {"approval_id": approval, "approve": last.content == "yes", "note": "said so"}
        return ScriptedModel.tool_call("decide_approval", json.dumps(arguments))
    if last.role == "user":
        return "Please answer yes or no."
    return "Noted: " + last.content


@pytest.mark.parametrize("answer", ["yes", "no"])
async def test_the_users_reply_confirms_through_the_decision_tool(
    open_agent: Any, answer: str
) -> None:
    shop = Shop()
    agent = open_agent(
        shop, [_both(), _confirming, _confirming, _confirming, _told], approval="user"
    )
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    assert parked.status == "awaiting_approval"
    # A reply that decides nothing leaves it waiting.
    unclear = await agent.run("hmm, what do you mean?", session="s1", user="u1")
    assert unclear.status == "awaiting_approval" and unclear.text == "Please answer yes or no."
    assert shop.refunds == []
    decided = await agent.run(answer, session="s1", user="u1")
    stored = await agent.approvals.store.aget("default", parked.approvals[0].id)
    if answer == "yes":
        assert stored.status == "approved" and stored.decision.by == "user:u1"
        assert shop.refunds == [("W1", 50)] and "approved by user:u1 (said so)" in decided.text
    else:
        assert stored.status == "rejected" and shop.refunds == []
        assert "rejected by user:u1" in decided.text
    assert decided.status == "completed"
    state = agent.session_state("s1")
    assert state is not None and state.runtime.awaiting == ()
    decisions = [m for m in state.messages if m.role == "tool" and m.name == "decide_approval"]
    assert len(decisions) == 1  # recorded like any call


async def test_a_revert_cancels_what_the_parked_turn_waited_for(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    first = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    [waiting] = first.approvals
    history = await agent.state.ahistory(agent.session_key("s1"))
    before_turn = min(info.version for info in history)
    # The operator's revert (the service's route and the viewer's form call this).
    reverted = await revert_holding_lease(
        agent, "s1", expected_version=first.state_version, to_version=before_turn
    )
    assert reverted.state.runtime.awaiting == ()
    stored = await agent.approvals.store.aget("default", waiting.id)
    assert stored.status == "cancelled" and "reverted" in (stored.status_reason or "")
    with pytest.raises(ApprovalSettledError, match=r"already cancelled .*reverted"):
        await agent.decide("s1", waiting.id, approve=True, by="alice")
    assert shop.refunds == []


async def test_every_request_and_decision_is_in_the_trace(open_agent: Any) -> None:
    shop = Shop()
    agent = open_agent(shop, [_both(), _told])
    parked = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    decided = await agent.decide("s1", parked.approvals[0].id, approve=True, by="alice")
    store = agent.tracer.store

    async def steps(run_id: str, name: str) -> list[Any]:
        detail = await store.aget_run_detail(run_id)
        return [step for step in detail.steps if step.name == name]

    requested = await steps(parked.run_id, "approval_requested")
    settled = await steps(decided.run_id, "approval_decided")
    assert [s.attributes["approval_id"] for s in requested] == [parked.approvals[0].id]
    [step] = settled
    assert (
        step.attributes["decided_by"] == "operator:alice"
        and step.attributes["status"] == "approved"
    )
    assert step.attributes["decided_at"] is not None


async def test_a_call_in_doubt_escalates_keeps_its_reads_and_resumes_with_the_verdict(
    open_agent: Any,
) -> None:
    shop = Shop()
    release = threading.Event()

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def cancel(order: str) -> str:
        """Cancel an order.

        Args:
            order: The order id.
        """
        shop.refunds.append((order, 0))
        release.wait(30)  # the shop's answer never comes in time
        return f"cancelled {order}"

    look = ScriptedModel.tool_call("look_up", '{"order": "W1"}')
    stop = ScriptedModel.tool_call("cancel", '{"order": "W1"}')
    agent = open_agent(shop, [look, stop, _told], extra=[cancel], escalate=True)
    try:
        stopped = await agent.run("Cancel W1.", session="s1", user="u1")
        assert stopped.status == "escalated" and not stopped.reverted, stopped
        [escalation] = stopped.approvals
        assert escalation.kind == "escalation" and escalation.tool == "cancel"
        assert escalation.decidable_by == ("operator",)
        state = agent.session_state("s1")
        assert state is not None and state.runtime.awaiting == (escalation.id,)
        # What the turn learned before it stopped stays in the model's view.
        assert any("W1: paid 80 EUR" in m.content for m in state.messages if m.role == "tool")
        [entry] = agent.journal.in_doubt(agent.session_key("s1"))
        agent.journal.resolve(entry.key, ok=True, content="cancelled W1 (checked by hand)")
        answered = await agent.decide(
            "s1", escalation.id, approve=True, by="alice", action="answer", note="it went through"
        )
        assert answered.status == "completed", answered
        assert "answered by operator:alice: it went through" in answered.text
        assert "it took effect (cancelled W1 (checked by hand))" in answered.text
        assert shop.refunds == [("W1", 0)]
    finally:
        release.set()


async def test_a_workflow_state_that_waits_for_the_user_says_what_it_awaits(
    open_agent: Any,
) -> None:
    machine = StateMachine(
        "refunds",
        states=[
            MachineState(
                "confirming",
                tools=("refund",),
                awaits_user="the user's yes or no to the refund of 50 EUR on W1",
            ),
            MachineState("done", terminal=True),
        ],
        transitions=[Transition("confirming", "done")],
        initial="confirming",
    )
    model_replies: list[Any] = ["Shall I refund 50 EUR on W1?"]
    agent = open_agent(Shop(), model_replies, machine=machine)
    await agent.run("Refund W1.", session="s1", user="u1")
    [call] = agent.model.calls
    prompt = "\n".join(m.content for m in call.messages)
    assert (
        "This step waits for the user: the user's yes or no to the refund of 50 EUR on W1" in prompt
    )


async def test_a_loop_after_the_warning_escalates_and_the_operators_text_resumes_it(
    open_agent: Any,
) -> None:
    shop = Shop()

    def stuck(call: ScriptedCall) -> Message | str:
        last = call.messages[-1]
        if last.role == "system" and "went to an operator" in last.content:
            return "Understood: " + last.content
        return ScriptedModel.tool_call("look_up", '{"order": "W1"}')

    agent = open_agent(shop, [], escalate=("loop_detected",))
    agent.model = ScriptedModel(stuck)  # the same reply to every call: it loops
    stopped = await agent.run("What about W1?", session="s1", user="u1")
    assert stopped.status == "escalated" and not stopped.reverted, stopped
    [escalation] = stopped.approvals
    assert escalation.kind == "escalation" and "loop_detected" in escalation.reason
    looked = len(shop.lookups)
    answered = await agent.decide(
        "s1", escalation.id, approve=True, by="alice", action="answer", note="W1 shipped today"
    )
    assert answered.status == "completed"
    assert "answered by operator:alice: W1 shipped today" in answered.text
    assert len(shop.lookups) == looked  # the operator's text, not another round of reads


async def test_without_a_queue_a_call_that_needs_approval_is_refused(tmp_path: Path) -> None:
    shop = Shop()
    database = SQLiteDatabase(tmp_path / "bare.db")
    agent = Agent(
        ScriptedModel([_both(), "I could not refund it."]),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You run a shop.",
        tools=_tools(shop, True),
    )
    reply = await agent.run("Refund 50 on W1.", session="s1", user="u1")
    assert reply.status == "completed" and shop.refunds == [] and shop.lookups == ["W1"]
    [refused] = [m for m in reply_messages(agent) if m.role == "tool" and m.name == "refund"]
    assert "has no approval queue" in refused.content
    with pytest.raises(UsageError, match="no approval queue"):
        await agent.decide("s1", "apr-1", approve=True, by="alice")
    database.close()


def reply_messages(agent: Agent) -> list[Message]:
    state = agent.session_state("s1")
    assert state is not None
    return state.messages
