"""Hashes of what a memory-off session shows, to compare two trees turn for turn.

The workload of ``keel bench turns``' keel session, memory off (`turn_instructions.bench_agent`):
``TURNS`` turns, then one hash each of every model call's messages (the OpenAI wire form), the
replies (status, text, steps, prompt figures, version, tool calls), the runs (status, input,
output, totals, attributes but the random ``turn_id``) and their steps as the trace API reads
them back (ids, times and latencies left out), and the checkpoint rows (every column but the
session, its epoch and the time; ids and times inside payloads replaced by ``<x>``)::

    PYTHONHASHSEED=0 PYTHONPATH=src python scripts/turn_hashes.py 1000

Run it on two trees (each on ``PYTHONPATH``): the same lines, the same behaviour.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import turn_instructions

from keel.bench._react import question
from keel.messages import Message
from keel.testing import ScriptedCall
from keel.tracing import RunQuery

_VARYING = re.compile(
    r"[0-9a-f]{32}|[0-9a-f]{16}|\d{4}-\d\d-\d\dT[0-9:.]+(?:Z|[+-]\d\d:\d\d)?"
    r"|\b1[6-9]\d{8}(?:\.\d+)?\b|\b1[6-9]\d{14,15}\b"
)
"""Ids (32 or 16 hex digits) and times (ISO, epoch seconds, epoch microseconds)."""
_STEP_VARYING = {
    "run_id",
    "step_id",
    "parent_id",
    "started_at",
    "ended_at",
    "latency_ms",
    "ttft_ms",
}


def _update(digest: Any, value: object) -> None:
    digest.update(json.dumps(value, sort_keys=True).encode())


def main(turns: int) -> None:
    digests = {
        name: hashlib.sha256() for name in ("messages", "replies", "runs", "steps", "checkpoints")
    }
    policy = turn_instructions._policy

    def hashing(call: ScriptedCall) -> Message | str:
        _update(digests["messages"], [message.to_openai() for message in call.messages])
        return policy(call)

    turn_instructions._policy = hashing
    with tempfile.TemporaryDirectory() as directory:
        agent = turn_instructions.bench_agent(Path(directory))

        async def drive() -> None:
            try:
                for turn in range(turns):
                    reply = await agent.handle("bench", "user", question(turn))
                    _update(
                        digests["replies"],
                        [
                            reply.status,
                            reply.text,
                            reply.steps,
                            reply.max_prompt_tokens,
                            reply.prompt_limit,
                            reply.state_version,
                            list(reply.tool_calls),
                        ],
                    )
                store = agent.tracer.store
                assert store is not None
                runs = store.list_runs(RunQuery(session_id="bench", limit=100_000))
                for run in sorted(runs, key=lambda run: run.started_at):
                    attributes = {k: v for k, v in run.attributes.items() if k != "turn_id"}
                    _update(
                        digests["runs"],
                        [
                            run.status,
                            run.input,
                            run.output,
                            run.step_count,
                            run.model_calls,
                            run.tool_calls,
                            run.prompt_tokens,
                            run.completion_tokens,
                            attributes,
                        ],
                    )
                    detail = await store.aget_run_detail(run.run_id)
                    assert detail is not None
                    for step in detail.steps:
                        data = step.model_dump(mode="json", exclude=_STEP_VARYING)
                        data["nested"] = step.parent_id is not None
                        _update(digests["steps"], data)
            finally:
                await agent.aclose()

        asyncio.run(drive())
        (database,) = Path(directory).rglob("*.db")
        with sqlite3.connect(database) as connection:
            columns = [
                row[1] for row in connection.execute("PRAGMA table_info(keel_state_checkpoints)")
            ]
            kept = [c for c in columns if c not in ("created_at", "session_id", "epoch")]
            rows = connection.execute(
                f"SELECT {', '.join(kept)} FROM keel_state_checkpoints ORDER BY version"
            )
            for row in rows:
                digests["checkpoints"].update(_VARYING.sub("<x>", json.dumps(row)).encode())
    for name, digest in digests.items():
        print(f"{name} {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
