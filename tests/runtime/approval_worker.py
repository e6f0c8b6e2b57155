"""A worker process for the approvals' kill tests: one ``Agent.open`` on a SQLite file (state,
journal, traces, the approvals queue), a scripted model that refunds what the user asks for,
and a ``refund`` tool that waits for an operator's approval and appends a line to an effects
file each time it runs (the outside world, counted by the tests).

``--do ask`` sends the user's message (the turn parks); ``--do decide --approval ID`` approves
the request as operator alice; ``--do resume`` resumes the session. ``--kill-at POINT`` sends
this process SIGKILL at POINT; each reply is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus
from keel.messages import Message
from keel.runtime import Agent, AgentReply
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

KILL_POINTS = (
    "after_request_added",
    "before_decision_commits",
    "after_decision_commits",
    "tool_before_effect",
    "tool_after_effect",
)


def _kill_if(args: argparse.Namespace, point: str) -> None:
    if args.kill_at == point:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def policy(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role in ("system", "tool"):
        return "Done: " + last.content  # keel's note on the decision, or the call's result
    order = call.last_user_text.removeprefix("refund ").split()[0]
    return ScriptedModel.tool_call("refund", json.dumps({"order": order}))


def build(args: argparse.Namespace) -> Agent:
    effects = Path(args.effects)

    @tool(approval=True)
    def refund(order: str) -> str:
        """Refund an order.

        Args:
            order: The order id.
        """
        _kill_if(args, "tool_before_effect")
        with effects.open("a", encoding="utf-8") as out:
            out.write(order + "\n")
            out.flush()
            os.fsync(out.fileno())
        _kill_if(args, "tool_after_effect")
        return f"REFUNDED {order}"

    agent = Agent.open(
        f"sqlite:///{args.db}",
        system_prompt="You refund orders.",
        model=ScriptedModel(policy),
        tools=[refund],
        memory=False,
    )
    assert agent.approvals is not None
    store = agent.approvals.store
    original = store.adecide

    async def adecide(
        tenant_id: str, request_id: str, status: ApprovalStatus, decision: ApprovalDecision
    ) -> tuple[ApprovalRequest, bool]:
        _kill_if(args, "before_decision_commits")
        settled = await original(tenant_id, request_id, status, decision)
        _kill_if(args, "after_decision_commits")
        return settled

    store.adecide = adecide  # type: ignore[method-assign]
    added = store.aadd

    async def aadd(request: ApprovalRequest) -> ApprovalRequest:
        stored = await added(request)
        _kill_if(args, "after_request_added")
        return stored

    store.aadd = aadd  # type: ignore[method-assign]
    return agent


def _line(reply: AgentReply | None) -> str:
    if reply is None:
        return json.dumps({"status": None})
    return json.dumps(
        {
            "status": reply.status,
            "text": reply.text,
            "approvals": [a.id for a in reply.approvals],
            "replayed": reply.replayed,
        }
    )


async def run(args: argparse.Namespace) -> None:
    agent = build(args)
    try:
        reply: Any
        if args.do == "ask":
            reply = await agent.run("refund W1", session="s1", user="u1")
        elif args.do == "pending":
            assert agent.approvals is not None
            waiting = await agent.approvals.store.alist("default", session_id="s1")
            reply = None
            print(json.dumps({"pending": [request.id for request in waiting]}), flush=True)
        elif args.do == "decide":
            reply = await agent.decide("s1", args.approval, approve=True, by="alice")
        else:
            reply = await agent.resume("s1", "u1")
        if args.do != "pending":
            print(_line(reply), flush=True)
    finally:
        await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--effects", required=True)
    parser.add_argument("--do", choices=("ask", "pending", "decide", "resume"), required=True)
    parser.add_argument("--approval", default="")
    parser.add_argument("--kill-at", default="")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
