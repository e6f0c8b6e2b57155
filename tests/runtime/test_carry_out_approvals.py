"""Through the Agent: a decision made elsewhere (``keel approvals approve`` on the command line,
which only records it) is carried out by ``agent.carry_out_decisions()``, exactly once even when
two processes' agents call it at once; and what the customer reads while a call waits is
written for a customer (issue 45). The queue is the SQLite store ``Agent.open`` opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keel.approvals import ApprovalDecision, arguments_digest
from keel.errors import ToolDefinitionError
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.runtime._decisions import RESUMING_GRACE_S
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import ApprovalNeed, schema_tool, tool

SRC = str(Path(__file__).resolve().parents[2] / "src")

DEFAULT_WAIT = (
    "I need a colleague to approve this before I go on; I'll continue as soon as it's decided."
)


def _refund_call(order: str = "1024", amount: float = 40.0) -> Message:
    arguments = json.dumps({"amount": amount, "order_id": order})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="issue_refund", arguments=arguments)]
    )


def _told(call: ScriptedCall) -> str:
    """The model's answer once the turn goes on: what keel told it of the decision."""
    notes = [m.content for m in call.messages if m.role == "system" and "approval" in m.content]
    return "Done. " + (notes[-1] if notes else "nothing")


def _refund_tool(refunds: list[str], **options: Any) -> Any:
    @tool(approval="operator", **options)
    def issue_refund(order_id: str, amount: float) -> str:
        """Refund an order.

        Args:
            order_id: The order.
            amount: Euros.
        """
        refunds.append(f"{order_id} {amount}")
        return f"refunded {amount} on {order_id}"

    return issue_refund


@pytest.fixture
def database(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keel.db'}"


@pytest.fixture
def open_agent(database: str) -> Iterator[Any]:
    agents: list[Agent] = []

    def build(refunds: list[str], replies: list[Any], **options: Any) -> Agent:
        waiting = options.pop("waiting_message", None)
        tool_options = {} if waiting is None else {"waiting_message": waiting}
        agent = Agent.open(
            database,
            system_prompt="You support a shop's customers.",
            model=ScriptedModel(replies),
            tools=[_refund_tool(refunds, **tool_options)],
            memory=False,
            **options,
        )
        agents.append(agent)
        return agent

    yield build
    for agent in agents:
        agent.close()


def _keel_approvals(database: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``keel approvals ARGS`` as an operator runs it, in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "keel", "approvals", *args, "--database", database],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    return done


def test_a_decision_on_the_command_line_is_carried_out_once(open_agent: Any, database: str) -> None:
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call(), _told, _refund_call("2048", 15.0), _told])
    parked = agent.run_sync("Refund my order 1024, please.", session="s1", user="ann")
    assert parked.status == "awaiting_approval" and refunds == []
    approval = parked.approvals[0].id
    # Nothing decided yet: nothing to carry out.
    assert agent.carry_out_decisions_sync() == []

    _keel_approvals(database, "approve", approval, "--by", "alice", "--note", "policy ok")
    assert refunds == []  # the command line records the decision; it runs no tool

    went = agent.carry_out_decisions_sync()
    assert len(went) == 1, went
    went_on = went[0]
    assert went_on.status == "completed" and went_on.session_id == "s1", went_on
    assert "approved by operator:alice (policy ok)" in went_on.text
    assert refunds == ["1024 40.0"]
    # Carried out: a second call finds nothing, and the session waits for nothing.
    assert agent.carry_out_decisions_sync() == []
    assert refunds == ["1024 40.0"]
    state = agent.session_state("s1")
    assert state is not None and state.runtime.awaiting == () and state.runtime.open_turn is None
    assert state.messages[-1].role == "assistant" and state.messages[-1].content == went_on.text

    # A rejection is carried out too: the turn goes on, the refund never runs.
    again = agent.run_sync("And refund 2048.", session="s1", user="ann")
    _keel_approvals(database, "reject", again.approvals[0].id, "--note", "not eligible")
    went = agent.carry_out_decisions_sync()
    assert len(went) == 1, went
    rejected = went[0]
    assert rejected.status == "completed" and "rejected" in rejected.text
    assert refunds == ["1024 40.0"]


def test_only_the_users_decisions_when_a_user_is_named(open_agent: Any, database: str) -> None:
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call(), _told])
    parked = agent.run_sync("Refund my order 1024, please.", session="s1", user="ann")
    _keel_approvals(database, "approve", parked.approvals[0].id)
    assert agent.carry_out_decisions_sync(user_id="bob") == [] and refunds == []
    assert [reply.session_id for reply in agent.carry_out_decisions_sync(user_id="ann")] == ["s1"]
    assert refunds == ["1024 40.0"]


def test_two_processes_carrying_out_at_once_go_on_once(open_agent: Any, database: str) -> None:
    """Two agents on one database (two processes' worth), both carrying out the same decision:
    the second has read the session as parked before the first's turn ends, so only its read
    under the lease can tell it that the turn went on."""
    refunds: list[str] = []
    running = threading.Event()
    second_looked = threading.Event()

    @tool(approval="operator")
    def issue_refund(order_id: str, amount: float) -> str:
        """Refund an order.

        Args:
            order_id: The order.
            amount: Euros.
        """
        running.set()
        # The first carrier's turn stays in flight until the second has read the session.
        assert second_looked.wait(60), "the second carrier never read the session"
        refunds.append(f"{order_id} {amount}")
        return f"refunded {amount} on {order_id}"

    def build() -> Agent:
        agent = Agent.open(
            database,
            system_prompt="You support a shop's customers.",
            model=ScriptedModel([_refund_call(), _told, _told]),
            tools=[issue_refund],
            memory=False,
            session_wait_s=60,
        )
        opened.append(agent)
        return agent

    opened: list[Agent] = []
    try:
        first, second = build(), build()
        parked = first.run_sync("Refund my order 1024, please.", session="s1", user="ann")
        _keel_approvals(database, "approve", parked.approvals[0].id)

        peek = second.state.apeek

        async def looked(key: str) -> Any:
            found = await peek(key)
            second_looked.set()
            return found

        second.state.apeek = looked  # type: ignore[method-assign]
        replies: dict[str, list[Any]] = {}

        def carry_out(name: str, agent: Agent) -> None:
            replies[name] = agent.carry_out_decisions_sync()

        one = threading.Thread(target=carry_out, args=("first", first))
        one.start()
        assert running.wait(60), "the first carrier did not carry the decision out"
        two = threading.Thread(target=carry_out, args=("second", second))
        two.start()
        one.join(120)
        two.join(120)
        assert refunds == ["1024 40.0"]
        assert len(replies["first"]) == 1 and replies["second"] == [], replies
    finally:
        for agent in opened:
            agent.close()


async def test_the_waiting_text_is_written_for_the_customer(open_agent: Any) -> None:
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call()])
    parked = await agent.run("Refund my order 1024, please.", session="s1", user="ann")
    assert parked.status == "awaiting_approval"
    again = await agent.run("Is it done yet?", session="s1", user="ann")
    assert again.status == "awaiting_approval"
    for reply in (parked, again):
        assert reply.text == DEFAULT_WAIT
        assert "{" not in reply.text and "issue_refund" not in reply.text
        assert "approval (" not in reply.text  # no reason repeated in brackets
    # The operator's detail stays in the request.
    [view] = parked.approvals
    assert view.tool == "issue_refund" and json.loads(view.arguments)["order_id"] == "1024"


async def test_a_tools_own_waiting_message_is_what_the_customer_reads(open_agent: Any) -> None:
    own = "I've asked a colleague to approve the refund; you'll hear from me within the hour."
    agent = open_agent([], [_refund_call()], waiting_message=own)
    parked = await agent.run("Refund my order 1024, please.", session="s1", user="ann")
    assert parked.status == "awaiting_approval" and parked.text == own
    again = await agent.run("Any news?", session="s1", user="ann")
    assert again.text == own


def test_a_waiting_message_needs_an_approval_and_words() -> None:
    def refund(order_id: str) -> str:
        """Refund.

        Args:
            order_id: The order.
        """
        return order_id

    with pytest.raises(ToolDefinitionError, match="no approval= policy"):
        tool(waiting_message="Hold on.")(refund)
    with pytest.raises(ToolDefinitionError, match="non-empty text"):
        tool(approval="operator", waiting_message="  ")(refund)

    async def call(arguments: dict[str, Any], context: Any) -> str:
        return "ok"

    built = schema_tool(
        "refund",
        "Refund an order.",
        {"properties": {"order_id": {"type": "string"}}},
        call,
        approval="operator",
        waiting_message="A colleague checks refunds first.",
    )
    assert built.waiting_message == "A colleague checks refunds first."


async def test_a_decision_that_goes_on_by_itself_is_left_to_its_decider_for_a_while(
    open_agent: Any,
) -> None:
    """A decision through HTTP or ``agent.decide`` goes on in the decider's own call: carrying
    it out at the same moment would answer that decider "settled" instead of the turn. Only
    when its decider died (the grace is over) is it carried out here."""
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call("1"), _refund_call("2"), _told])
    just_now = await agent.run("Refund order 1.", session="s1", user="ann")
    long_ago = await agent.run("Refund order 2.", session="s2", user="ann")

    async def decided_over_http(parked: Any, decided_at: float) -> None:
        decision = ApprovalDecision(
            approve=True,
            by="operator:alice",
            decided_at=decided_at,
            channel="http",
            arguments_digest=arguments_digest(parked.approvals[0].arguments),
        )
        await agent.approvals.store.adecide("default", parked.approvals[0].id, "approved", decision)

    # s1's decider is about to go on with its turn; s2's died before it could.
    await decided_over_http(just_now, time.time())
    await decided_over_http(long_ago, time.time() - RESUMING_GRACE_S - 1)
    went_on = await agent.carry_out_decisions()
    assert [reply.session_id for reply in went_on] == ["s2"]
    assert refunds == ["2 40.0"]


def test_an_expired_request_lets_its_turn_go_on_without_the_call(database: str) -> None:
    refunds: list[str] = []

    def briefly(arguments: Any, context: Any) -> ApprovalNeed:
        # Past its expiry as soon as it is stored: nobody decides in time.
        return ApprovalNeed("operator", "refunds need an operator", expires_after_s=1e-6)

    @tool(approval=briefly)
    def issue_refund(order_id: str, amount: float) -> str:
        """Refund an order.

        Args:
            order_id: The order.
            amount: Euros.
        """
        refunds.append(order_id)
        return "refunded"

    with Agent.open(
        database,
        system_prompt="You support a shop's customers.",
        model=ScriptedModel([_refund_call(), _told]),
        tools=[issue_refund],
        memory=False,
    ) as agent:
        parked = agent.run_sync("Refund my order 1024, please.", session="s1", user="ann")
        assert parked.status == "awaiting_approval"
        went = agent.carry_out_decisions_sync()
        assert len(went) == 1, went
        went_on = went[0]
    assert went_on.status == "completed" and "expired without a decision" in went_on.text
    assert refunds == []


def test_an_agent_without_the_tool_leaves_the_decision_to_the_one_with_it(
    open_agent: Any, database: str
) -> None:
    """``keel ui`` (an agent with no tools) on the application's database must not carry out
    the application's refund: it could not run it, and the turn would go on without it."""
    refunds: list[str] = []
    application = open_agent(refunds, [_refund_call(), _told])
    parked = application.run_sync("Refund my order 1024, please.", session="s1", user="ann")
    _keel_approvals(database, "approve", parked.approvals[0].id)

    @tool
    def lookup_order(order_id: str) -> str:
        """Look an order up.

        Args:
            order_id: The order.
        """
        return order_id

    for tools in ([], [lookup_order]):
        with Agent.open(
            database,
            system_prompt="Another application's agent.",
            model=ScriptedModel([_told]),
            tools=tools,
            memory=False,
        ) as other:
            assert other.carry_out_decisions_sync() == []
    went = application.carry_out_decisions_sync()
    assert [reply.status for reply in went] == ["completed"] and refunds == ["1024 40.0"]
