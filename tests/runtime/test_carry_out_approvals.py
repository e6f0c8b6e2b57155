"""Through the Agent: a decision made elsewhere (``keel approvals approve`` on the command line,
which only records it) is carried out by ``agent.carry_out_decisions()``, exactly once even when
two processes' agents call it at once; and what the customer reads while a call waits is
written for a customer (issue 45). The queue is the SQLite store ``Agent.open`` opens."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keel._bridge import run_sync
from keel.approvals import ApprovalDecision, arguments_digest
from keel.errors import ToolDefinitionError
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.runtime._session import RESUMING_GRACE_S
from keel.service._access import revert_holding_lease
from keel.testing import ScriptedModel
from keel.tools import ApprovalNeed, schema_tool, tool
from tests.approvals._refunds import refund_tool, told

SRC = str(Path(__file__).resolve().parents[2] / "src")

DEFAULT_WAIT = (
    "I need a colleague to approve this before I go on; I'll continue as soon as it's decided."
)


def _refund_call(order: str = "1024", amount: float = 40.0) -> Message:
    arguments = json.dumps({"amount": amount, "order_id": order})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="issue_refund", arguments=arguments)]
    )


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
            tools=[refund_tool(refunds, **tool_options)],
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
    agent = open_agent(refunds, [_refund_call(), told, _refund_call("2048", 15.0), told])
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
    agent = open_agent(refunds, [_refund_call(), told])
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
            model=ScriptedModel([_refund_call(), told, told]),
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
    agent = open_agent(refunds, [_refund_call("1"), _refund_call("2"), told])
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
        model=ScriptedModel([_refund_call(), told]),
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
    application = open_agent(refunds, [_refund_call(), told])
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
            model=ScriptedModel([told]),
            tools=tools,
            memory=False,
        ) as other:
            assert other.carry_out_decisions_sync() == []
    went = application.carry_out_decisions_sync()
    assert [reply.status for reply in went] == ["completed"] and refunds == ["1024 40.0"]


# --- a pass reads what is left to carry out, never the history --------------------------------


def _old_decided(database_file: Path, count: int, *, carried_out: bool, sessions: int) -> None:
    """``count`` requests decided on the command line long ago, bulk-inserted into the queue
    (``sessions`` sessions with no state), carried out already when ``carried_out``."""
    long_ago = time.time() - 86_400
    rows = []
    for index in range(count):
        decision = ApprovalDecision(
            approve=True, by="operator:olga", decided_at=long_ago + index, channel="cli"
        )
        rows.append(
            {
                "tenant_id": "default",
                "id": f"apr-old-{index:06d}",
                "user_id": "ann",
                "session_id": f"old-{index % sessions}",
                "turn_id": f"t-{index}",
                "kind": "operator",
                "tool": "issue_refund",
                "call_id": f"c-{index}",
                "arguments": '{"amount": 1.0, "order_id": "1"}',
                "reason": "refunds need an operator",
                "step": 0,
                "created_at": long_ago + index,
                "status": "approved",
                "decision": decision.model_dump_json(),
                "metadata": "{}",
            }
        )
    with contextlib.closing(sqlite3.connect(database_file)) as db, db:
        names = list(rows[0])
        db.executemany(
            f"INSERT INTO keel_approvals ({', '.join(names)}) "
            f"VALUES ({', '.join('?' for _ in names)})",
            [tuple(row.values()) for row in rows],
        )
        columns = {row[1] for row in db.execute("PRAGMA table_info(keel_approvals)")}
        if carried_out and "carried_out_at" in columns:
            db.execute(
                "UPDATE keel_approvals SET carried_out_at = ? WHERE id LIKE 'apr-old-%'",
                (long_ago,),
            )


def _counting_peeks(agent: Agent) -> list[str]:
    """The session keys ``agent``'s state store is peeked at, from now on."""
    peeked: list[str] = []
    peek = agent.state.apeek

    async def counted(key: str) -> Any:
        peeked.append(key)
        return await peek(key)

    agent.state.apeek = counted  # type: ignore[method-assign]
    return peeked


def _decide_in_store(
    agent: Agent, approval_id: str, *, decided_at: float | None = None, approve: bool = True
) -> None:
    """A decision as ``keel approvals approve`` records it (channel ``cli``), at ``decided_at``."""
    found = agent.approvals.store  # type: ignore[union-attr]
    request = run_sync(found.aget("default", approval_id))
    assert request is not None
    decision = ApprovalDecision(
        approve=approve,
        by="operator:alice",
        decided_at=time.time() if decided_at is None else decided_at,
        channel="cli",
        arguments_digest=arguments_digest(request.arguments),
    )
    run_sync(found.adecide("default", approval_id, "approved" if approve else "rejected", decision))


def _carried_out_at(agent: Agent, approval_id: str) -> float | None:
    request = run_sync(agent.approvals.store.aget("default", approval_id))  # type: ignore[union-attr]
    assert request is not None
    return getattr(request, "carried_out_at", None)


def test_a_pass_peeks_only_the_session_of_the_new_decision(
    open_agent: Any, database: str, tmp_path: Path
) -> None:
    """2,000 decisions carried out long ago and one new decision on the command line: the
    pass looks at the one session whose turn waits for it, not at the history."""
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call(), told])
    parked = agent.run_sync("Refund my order 1024, please.", session="s1", user="ann")
    _old_decided(tmp_path / "keel.db", 2000, carried_out=True, sessions=2000)
    _keel_approvals(database, "approve", parked.approvals[0].id)
    peeked = _counting_peeks(agent)
    went = agent.carry_out_decisions_sync()
    assert [reply.session_id for reply in went] == ["s1"] and refunds == ["1024 40.0"]
    assert set(peeked) == {agent.session_key("s1")}, f"{len(set(peeked))} sessions peeked"
    # Carried out: the next pass reads nothing and peeks nothing.
    peeked.clear()
    assert agent.carry_out_decisions_sync() == [] and peeked == []
    assert _carried_out_at(agent, parked.approvals[0].id) is not None


def test_a_new_decision_past_the_old_scan_limit_is_carried_out(
    open_agent: Any, tmp_path: Path
) -> None:
    """More decided requests than a pass once read (10,000), none marked carried out (as after
    the upgrade): the newest decision is still carried out, and the old ones, whose sessions
    wait for nothing, are marked, so the next pass reads none of them."""
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call(), told])
    parked = agent.run_sync("Refund my order 1024, please.", session="s1", user="ann")
    _old_decided(tmp_path / "keel.db", 10_001, carried_out=False, sessions=7)
    _decide_in_store(agent, parked.approvals[0].id)
    went = agent.carry_out_decisions_sync()
    assert [reply.session_id for reply in went] == ["s1"] and refunds == ["1024 40.0"]
    peeked = _counting_peeks(agent)
    assert agent.carry_out_decisions_sync() == [] and peeked == []


def test_every_way_a_parked_turn_goes_on_marks_its_request(open_agent: Any) -> None:
    refunds: list[str] = []
    script = [_refund_call("1"), told, _refund_call("2"), told, _refund_call("3"), told]
    agent = open_agent(refunds, [*script, _refund_call("4"), told, "You're welcome."])
    # Agent.decide: the decider goes on with the turn.
    first = agent.run_sync("Refund order 1.", session="s1", user="ann")
    agent.decide_sync("s1", first.approvals[0].id, approve=True, by="alice")
    # Decided elsewhere, then Agent.resume.
    second = agent.run_sync("Refund order 2.", session="s2", user="ann")
    _decide_in_store(agent, second.approvals[0].id)
    assert agent.resume_sync("s2", "ann") is not None
    # Rejected on the command line, then the carrier.
    third = agent.run_sync("Refund order 3.", session="s3", user="ann")
    _decide_in_store(agent, third.approvals[0].id, approve=False)
    assert [reply.session_id for reply in agent.carry_out_decisions_sync()] == ["s3"]
    # Decided elsewhere, then the user's next message.
    fourth = agent.run_sync("Refund order 4.", session="s4", user="ann")
    _decide_in_store(agent, fourth.approvals[0].id)
    answered = agent.run_sync("Thanks!", session="s4", user="ann")
    assert answered.interrupted_turn is not None
    assert refunds == ["1 40.0", "2 40.0", "4 40.0"]
    for reply in (first, second, third, fourth):
        assert _carried_out_at(agent, reply.approvals[0].id) is not None, reply.approvals[0].id


def test_a_decision_its_session_no_longer_waits_for_is_marked_after_the_grace(
    open_agent: Any,
) -> None:
    """Decided, then reverted away: not carried out, and not read again by later passes once
    the decision is older than the grace (a younger one is looked at until then)."""
    refunds: list[str] = []
    agent = open_agent(refunds, [_refund_call("1"), _refund_call("2")])
    recent = agent.run_sync("Refund order 1.", session="s1", user="ann")
    old = agent.run_sync("Refund order 2.", session="s2", user="ann")
    for session, reply, at in (("s1", recent, time.time()), ("s2", old, time.time() - 3600)):
        _decide_in_store(agent, reply.approvals[0].id, decided_at=at)
        key = agent.session_key(session)
        history = run_sync(agent.state.ahistory(key))
        current = max(info.version for info in history)
        first = min(info.version for info in history)
        run_sync(revert_holding_lease(agent, session, expected_version=current, to_version=first))
        state = agent.session_state(session)
        assert state is not None and state.runtime.awaiting == ()
    peeked = _counting_peeks(agent)
    assert agent.carry_out_decisions_sync() == [] and refunds == []
    assert sorted(set(peeked)) == [agent.session_key("s1"), agent.session_key("s2")]
    assert _carried_out_at(agent, old.approvals[0].id) is not None
    assert _carried_out_at(agent, recent.approvals[0].id) is None
    peeked.clear()
    assert agent.carry_out_decisions_sync() == []
    assert peeked == [agent.session_key("s1")]


def test_a_request_decided_before_its_turn_parks_on_it_is_not_dropped(database: str) -> None:
    """The request is stored a moment before the checkpoint that parks on it: a decision in
    between (long enough ago to be past any grace), and a pass peeking then, finds the session
    not parked on it yet. The pass must leave it, and carry it out once the turn parks."""
    refunds: list[str] = []
    checking = threading.Event()
    release = threading.Event()

    @tool
    def check_stock(order_id: str) -> str:
        """Check the order's stock.

        Args:
            order_id: The order.
        """
        checking.set()
        assert release.wait(60), "the test never released the step"
        return "in stock"

    both = Message.assistant(
        "",
        tool_calls=[
            ToolCall(id="c1", name="issue_refund", arguments='{"amount": 5.0, "order_id": "7"}'),
            ToolCall(id="c2", name="check_stock", arguments='{"order_id": "7"}'),
        ],
    )

    def build(replies: list[Any]) -> Agent:
        return Agent.open(
            database,
            system_prompt="You support a shop's customers.",
            model=ScriptedModel(replies),
            tools=[refund_tool(refunds), check_stock],
            memory=False,
        )

    with build([both]) as application, build([told]) as carrier:
        parked: list[Any] = []
        turn = threading.Thread(
            target=lambda: parked.append(
                application.run_sync("Refund order 7.", session="s1", user="ann")
            )
        )
        turn.start()
        try:
            # The refund's request is stored; the step's other call still runs: not parked yet.
            assert checking.wait(60), "the step never reached its second call"
            [request] = run_sync(carrier.approvals.store.alist("default"))  # type: ignore[union-attr]
            _decide_in_store(carrier, request.id, decided_at=time.time() - 3600)
            assert carrier.carry_out_decisions_sync() == []
            assert _carried_out_at(carrier, request.id) is None, "dropped before its turn parked"
        finally:
            release.set()
            turn.join(60)
        assert [reply.status for reply in parked] == ["awaiting_approval"]
        went = carrier.carry_out_decisions_sync()
        assert [reply.session_id for reply in went] == ["s1"] and refunds == ["7 5.0"]
        assert _carried_out_at(carrier, request.id) is not None
