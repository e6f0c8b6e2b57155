"""A worker process for the vault's crash test: an ``Agent.open`` on a SQLite file whose PII
vault comes from ``KEEL_PII_KEY``, a scripted model that sends the receipt to the address it
was shown (a placeholder), and a ``send_receipt`` tool (side-effecting, idempotent) that
appends the address it received to an effects file. ``--kill-at-send N`` SIGKILLs the process
the N-th time the tool is entered, before it writes anything.

Run as ``python -m tests.runtime.vault_worker --db D --effects E --texts '["..."]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
from pathlib import Path

from keel.messages import Message
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool


def policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Sent."
    if "receipt" in call.last_user_text:
        shown = "\n".join(message.content for message in call.messages)
        return ScriptedModel.tool_call(
            "send_receipt", json.dumps({"email": re.findall(r"<EMAIL_\d+>", shown)[0]})
        )
    return "Noted."


def build(args: argparse.Namespace) -> Agent:
    effects = Path(args.effects)
    entered = {"count": 0}

    @tool(side_effect=True, idempotent=True)
    def send_receipt(email: str) -> str:
        """Send the receipt of the last order.

        Args:
            email: Where to send it.
        """
        entered["count"] += 1
        if entered["count"] == args.kill_at_send:
            os.kill(os.getpid(), signal.SIGKILL)
        with effects.open("a", encoding="utf-8") as out:
            out.write(email + "\n")
        return f"receipt sent to {email}"

    return Agent.open(
        f"sqlite:///{args.db}",
        model=ScriptedModel(policy),
        system_prompt="You help customers.",
        tools=[send_receipt],
        memory=False,
        lease_ttl_s=1.0,
    )


async def run(args: argparse.Namespace) -> None:
    agent = build(args)
    try:
        if args.resume:
            resumed = await agent.resume("s1", "alice")
            if resumed is not None:
                print(json.dumps({"resumed": resumed.status, "reply": resumed.text}), flush=True)
        for text in json.loads(args.texts):
            reply = await agent.run(text, session="s1", user="alice")
            print(json.dumps({"status": reply.status, "reply": reply.text}), flush=True)
    finally:
        await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--effects", required=True)
    parser.add_argument("--texts", default="[]")
    parser.add_argument("--kill-at-send", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
