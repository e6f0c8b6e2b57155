"""A worker process for the Agent's cross-process tests.

One ``Agent`` on a SQLite file (state, journal, traces), a scripted model that books what the
user asks for, and a ``book`` tool (side-effecting, not idempotent) whose every run appends a
line to an effects file: the outside world, counted by the tests. ``--kill-at POINT:N`` sends
this process SIGKILL at the N-th time it reaches POINT; each reply is printed as one JSON line.

Run as ``python -m tests.runtime.agent_worker --db D --effects E --texts '["book A1"]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from keel.context import ContextBudget, Conversation
from keel.guards import GuardConfig
from keel.messages import Message
from keel.runtime import Agent, AgentReply, TextDelta, TurnFinished
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.stores._sql_traces import SQLTraceStore
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from keel.tracing import Tracer

KILL_POINTS = (
    "before_checkpoint",
    "checkpoint_written",
    "after_model_reply",
    "tool_before_effect",
    "tool_after_effect",
    "after_tool_before_checkpoint",
    "commit_before_write",
    "commit_after_write",
    "during_summary",
)


class _Killer:
    def __init__(self, spec: str) -> None:
        point, _, nth = spec.partition(":")
        self.point = point
        self.nth = int(nth or 1)
        self.seen: Counter[str] = Counter()

    def reached(self, point: str) -> None:
        self.seen[point] += 1
        if point == self.point and self.seen[point] == self.nth:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def policy(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}. " + "Anything else I can do for you today? " * 12
    text = call.last_user_text
    if text.startswith("book "):
        ref = text.removeprefix("book ").split()[0]
        return ScriptedModel.tool_call("book", json.dumps({"ref": ref}))
    return "Noted. " + "words " * 30


def build(args: argparse.Namespace, killer: _Killer) -> tuple[Agent, SQLiteDatabase]:
    effects = Path(args.effects)

    @tool(side_effect=True, idempotent=False)
    def book(ref: str) -> str:
        """Book a seat.

        Args:
            ref: The booking's business reference.
        """
        killer.reached("tool_before_effect")
        with effects.open("a", encoding="utf-8") as out:
            out.write(ref + "\n")
            out.flush()
            os.fsync(out.fileno())
        killer.reached("tool_after_effect")
        return f"BOOKED {ref}"

    database = SQLiteDatabase(args.db)
    traces = SQLTraceStore(database)
    traces.setup()
    # Streamed, the reply arrives over time, as from a real server (the kill lands mid-way).
    model = ScriptedModel(policy, stream_delay_s=0.001)
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You book seats.",
        tools=[book],
        journal=SQLToolJournal(database),
        tracer=Tracer(traces),
        context=ContextBudget(working_budget=args.budget),
        guards=GuardConfig(run_timeout_s=60, model_timeout_s=30, tool_timeout_s=30),
        lease_ttl_s=args.lease_ttl,
        session_wait_s=args.wait,
    )
    tool_ran = {"count": 0}

    def before_write(options: dict[str, Any]) -> None:
        reason = options.get("reason", "")
        if reason == "before model call":
            if tool_ran["count"]:
                killer.reached("after_tool_before_checkpoint")
            killer.reached("before_checkpoint")
        if reason == "turn completed":
            killer.reached("commit_before_write")

    def after_write(options: dict[str, Any]) -> None:
        reason = options.get("reason", "")
        if reason == "before model call":
            # Committed; the trace gathered up to it is not flushed yet.
            killer.reached("checkpoint_written")
        if reason == "turn completed":
            killer.reached("commit_after_write")
            tool_ran["count"] = 0

    # Every way of writing (a whole state or an append of what the turn added, either twin),
    # so the kill points hold whichever one the Agent writes through.
    def hooked_async(write: Any) -> Any:
        async def hooked(session_id: str, value: Any, **options: Any) -> int:
            before_write(options)
            version = await write(session_id, value, **options)
            after_write(options)
            return int(version)

        return hooked

    def hooked_sync(write: Any) -> Any:
        def hooked(session_id: str, value: Any, **options: Any) -> int:
            before_write(options)
            version = write(session_id, value, **options)
            after_write(options)
            return int(version)

        return hooked

    for name in ("acheckpoint", "aappend"):
        setattr(agent.state, name, hooked_async(getattr(agent.state, name)))
    for name in ("checkpoint", "append"):
        setattr(agent.state, name, hooked_sync(getattr(agent.state, name)))

    original_complete = model.acomplete

    async def complete(*call_args: Any, **call_kwargs: Any) -> Any:
        completion = await original_complete(*call_args, **call_kwargs)
        if completion.message.tool_calls:
            tool_ran["count"] += 1
        killer.reached("after_model_reply")
        return completion

    model.acomplete = complete  # type: ignore[method-assign]

    original_summarize = Conversation.asummarize

    async def summarize(self: Conversation, *, force: bool = False) -> Any:
        killer.reached("during_summary")
        return await original_summarize(self, force=force)

    Conversation.asummarize = summarize  # type: ignore[method-assign]
    return agent, database


async def _streamed(
    agent: Agent, args: argparse.Namespace, text: str, killer: _Killer
) -> AgentReply:
    async for event in agent.stream(text, session=args.session, user=args.user):
        if isinstance(event, TextDelta):
            killer.reached("mid_stream")
        if isinstance(event, TurnFinished):
            return event.reply
    raise AssertionError("the stream ended without its reply")


async def run(args: argparse.Namespace) -> None:
    killer = _Killer(args.kill_at)
    agent, database = build(args, killer)
    try:
        if args.resume:
            resumed = await agent.resume(args.session, args.user)
            if resumed is not None:
                print(
                    json.dumps({"resumed": True, "status": resumed.status, "reply": resumed.text}),
                    flush=True,
                )
        for text in json.loads(args.texts):
            if args.stream:
                reply = await _streamed(agent, args, text, killer)
            else:
                reply = await agent.handle(args.session, args.user, text)
            print(
                json.dumps(
                    {
                        "text": text,
                        "status": reply.status,
                        "reply": reply.text,
                        "interrupted": reply.interrupted_turn is not None,
                    }
                ),
                flush=True,
            )
    finally:
        await agent.aclose()
        database.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--effects", required=True)
    parser.add_argument("--session", default="s1")
    parser.add_argument("--user", default="u1")
    parser.add_argument("--texts", default="[]")
    parser.add_argument("--kill-at", default="")
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=60.0)
    parser.add_argument("--budget", type=int, default=8_000)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stream", action="store_true", help="run turns with Agent.stream")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
