"""``keel bench mcp``: what keel adds to an MCP tool call, and exactly-once under SIGKILL.

Latency: the same read-only tool (``echo``) of keel's fault server (a real MCP server in its
own process, over stdio) called through the raw SDK client and through keel's executor (look
up, validate against the JSON schema, hop to the connection's loop and back, cap the output),
in interleaved blocks; keel's added time is the difference of the two at p50 and p95.

Exactly-once: ``kills`` rounds, each a worker process (an Agent on a SQLite file, the fault
server over stdio) whose turn makes two writes, SIGKILLed with its server at one point chosen
from a seeded shuffle (every point once in each four rounds; which write, seeded too):

- ``mid_write``: the server applied the write and its answer has not come back;
- ``model_answered``: the model's call of the write arrived, nothing of it recorded yet;
- ``tool_recorded``: the write's result is journalled and checkpointed, the next model call
  started;
- ``before_commit``: the final answer arrived, the turn not yet committed.

A new worker process sends the same message (the client's retry) and finishes the turn: a
write in doubt is not run again; the operator settles it from the server's effects, and one
more turn ("go on") lets the agent do what is left. Counted from the server's own effects file
per point: writes applied twice (doubled) and writes never applied (missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from mcp import Client, StdioServerParameters
from pydantic import BaseModel

from keel.bench._stats import nearest_rank
from keel.messages import ToolCall
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing.mcp_fault_server import stdio_server
from keel.tools import ToolExecutor, ToolRegistry

__all__ = ["MCPBenchReport", "run_mcp_bench"]

_BLOCK = 25
"""Calls per block; the raw and keel blocks alternate, so drift hits both alike."""


class MCPBenchReport(BaseModel):
    """``keel bench mcp``'s figures."""

    calls: int
    raw_ms_p50: float
    raw_ms_p95: float
    keel_ms_p50: float
    keel_ms_p95: float
    added_ms_p50: float
    added_ms_p95: float
    kills: int
    seed: int
    in_doubt_after_resume: int
    doubled: int
    missing: int
    points: dict[str, dict[str, int]]
    """Per kill point: its ``kills``, ``doubled`` and ``missing``."""
    seconds: float


def run_mcp_bench(calls: int = 500, kills: int = 5, seed: int = 7) -> MCPBenchReport:
    """Measure ``calls`` calls each way and ``kills`` SIGKILLs at seeded points."""
    started = time.perf_counter()
    with TemporaryDirectory(prefix="keel-bench-mcp-") as folder:
        raw, through_keel = asyncio.run(_latencies(Path(folder), calls))
        doubt, points = _kill_rounds(Path(folder), kills, random.Random(seed))
    raw_p50, raw_p95 = nearest_rank(raw, 0.5), nearest_rank(raw, 0.95)
    keel_p50, keel_p95 = nearest_rank(through_keel, 0.5), nearest_rank(through_keel, 0.95)
    return MCPBenchReport(
        calls=calls,
        raw_ms_p50=round(raw_p50, 3),
        raw_ms_p95=round(raw_p95, 3),
        keel_ms_p50=round(keel_p50, 3),
        keel_ms_p95=round(keel_p95, 3),
        added_ms_p50=round(keel_p50 - raw_p50, 3),
        added_ms_p95=round(keel_p95 - raw_p95, 3),
        kills=kills,
        seed=seed,
        in_doubt_after_resume=doubt,
        doubled=sum(point["doubled"] for point in points.values()),
        missing=sum(point["missing"] for point in points.values()),
        points=points,
        seconds=round(time.perf_counter() - started, 1),
    )


async def _latencies(folder: Path, calls: int) -> tuple[list[float], list[float]]:
    server = stdio_server(folder / "latency-effects.txt")
    parameters = StdioServerParameters(
        command=server.command or "",
        args=list(server.args),
        env=dict(server.env),
    )
    raw: list[float] = []
    through_keel: list[float] = []
    with server:
        executor = ToolExecutor(ToolRegistry(server.tools().values()))
        async with Client(parameters, mode="legacy", cache=None) as client:
            for _ in range(5):  # warm both paths
                await client.call_tool("echo", {"text": "warm"})
                await _keel_call(executor, 0)
            while len(raw) < calls:
                for _ in range(min(_BLOCK, calls - len(raw))):
                    began = time.perf_counter()
                    await client.call_tool("echo", {"text": "hello"})
                    raw.append((time.perf_counter() - began) * 1000)
                for _ in range(min(_BLOCK, calls - len(through_keel))):
                    began = time.perf_counter()
                    await _keel_call(executor, len(through_keel))
                    through_keel.append((time.perf_counter() - began) * 1000)
    return raw, through_keel


async def _keel_call(executor: ToolExecutor, step: int) -> None:
    call = ToolCall(id=f"c{step}", name="echo", arguments='{"text": "hello"}')
    result = await executor.execute(call, session_id="bench", step=step)
    if result.content != "hello":
        raise RuntimeError(f"keel's call failed: {result.content}")


KILL_POINTS = ("mid_write", "model_answered", "tool_recorded", "before_commit")
"""Where a worker is SIGKILLed (see the module docstring)."""


def _kill_rounds(
    folder: Path, kills: int, rng: random.Random
) -> tuple[int, dict[str, dict[str, int]]]:
    """(turns that found a write in doubt on resuming, per point: kills, doubled, missing),
    counted from the server's effects."""
    database = folder / "kills.db"
    effects = folder / "effects.txt"
    in_doubt = 0
    order: list[str] = []
    rounds: list[tuple[str, int]] = []
    for round_number in range(kills):
        if not order:
            order = rng.sample(KILL_POINTS, len(KILL_POINTS))
        point, target = order.pop(), rng.randrange(2)
        rounds.append((point, target))
        worker = _worker(database, effects, round_number, point, target)
        if point == "mid_write":
            item = _items(round_number, point, target)[target]
            _wait_for(lambda item=item: item in _applied(effects), worker)
            os.killpg(worker.pid, signal.SIGKILL)  # the agent and its server, mid-write
        worker.wait()  # the other points: it kills itself (and its server) there
        in_doubt += _finish(database, effects, round_number, point, target)["in_doubt"]
    _settle(database, effects)
    for round_number, (point, target) in enumerate(rounds):
        _finish(database, effects, round_number, point, target, text="Go on.")
    applied = Counter(_applied(effects))
    points = {point: {"kills": 0, "doubled": 0, "missing": 0} for point in KILL_POINTS}
    for round_number, (point, target) in enumerate(rounds):
        items = _items(round_number, point, target)
        points[point]["kills"] += 1
        points[point]["doubled"] += sum(1 for item in items if applied[item] > 1)
        points[point]["missing"] += sum(1 for item in items if applied[item] == 0)
    return in_doubt, points


def _items(round_number: int, point: str, target: int) -> tuple[str, ...]:
    """The round's two writes; the one killed mid-write is ``slow:``, so the server answers
    it only after the kill."""
    items = [f"a{round_number}", f"b{round_number}"]
    if point == "mid_write":
        items[target] = "slow:" + items[target]
    return tuple(items)


def _finish(
    database: Path, effects: Path, round_number: int, point: str, target: int, text: str = ""
) -> dict[str, Any]:
    """A new worker process's turn (the same message again by default: the client's retry)."""
    resumed = _worker(database, effects, round_number, point, target, text=text, kill=False)
    out, _ = resumed.communicate(timeout=300)
    if resumed.returncode != 0:
        raise RuntimeError(f"the resumed worker failed ({resumed.returncode})")
    reply: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return reply


def _settle(database: Path, effects: Path) -> None:
    """The operator's part: each in-doubt write settled from what the server applied."""
    applied = set(_applied(effects))
    url = f"sqlite:///{database}"
    with Backends.open(url, settings=load_settings(), only=("journal",), redis_url="") as opened:
        journal = opened.journal
        for entry in journal.in_doubt():
            item = json.loads(entry.arguments).get("item", "")
            journal.resolve(entry.key, ok=item in applied, content=f"settled: {item in applied}")


def _applied(effects: Path) -> list[str]:
    return effects.read_text(encoding="utf-8").splitlines() if effects.exists() else []


def _wait_for(condition: Any, worker: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        if worker.poll() is not None:
            raise RuntimeError(f"the worker ended early: {worker.communicate()}")
        if time.monotonic() > deadline:
            raise RuntimeError("the write never reached the server")
        time.sleep(0.01)


def _worker(
    database: Path,
    effects: Path,
    round_number: int,
    point: str,
    target: int,
    *,
    text: str = "",
    kill: bool = True,
) -> subprocess.Popen[str]:
    job = {"round": round_number, "point": point, "target": target, "kill": kill, "text": text}
    return subprocess.Popen(
        [sys.executable, "-m", "keel.bench.mcp", str(database), str(effects), json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: the kill takes its server too
        env={**os.environ, "KEEL_DATA_DIR": str(database.parent / "data")},
    )


def _killed_here() -> None:
    """SIGKILL this worker's process group: itself and its MCP server, at once."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _grounded(job: dict[str, Any]) -> Any:
    """The worker's model: it writes the round's items in order, each until it sees it
    written (or in doubt: then the operator is left to check it, and it is not called again),
    then answers; at the job's kill point it SIGKILLs its own process group."""
    # The worker's half only: the bench's own process never builds a model.
    from keel.messages import Message
    from keel.testing import ScriptedModel

    items = _items(job["round"], job["point"], job["target"])
    kill_at = job["point"] if job["kill"] else None
    target = items[job["target"]]

    def decide(call: Any) -> Message:
        asked = {
            c.id: json.loads(c.arguments).get("item") for m in call.messages for c in m.tool_calls
        }
        answered = {asked.get(m.tool_call_id) for m in call.messages if m.role == "tool"}
        last = call.messages[-1]
        if (
            kill_at == "tool_recorded"
            and last.role == "tool"
            and asked.get(last.tool_call_id) == target
        ):
            _killed_here()
        pending = [item for item in items if item not in answered]
        if not pending:
            if kill_at == "before_commit":
                _killed_here()
            return Message.assistant("Both written.")
        if kill_at == "model_answered" and pending[0] == target:
            _killed_here()
        # Unique ids, as a provider's: the calls of several processes share the history.
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        return ScriptedModel.tool_call("write", json.dumps({"item": pending[0]}), call_id)

    return ScriptedModel([decide] * 12)


async def _work(database: Path, effects: Path, job: dict[str, Any]) -> dict[str, Any]:
    """One worker's turn: the model writes the round's two items through the fault server."""
    # Only a worker process builds an Agent: the bench's own process measures the executor.
    from keel.runtime import Agent

    round_number = job["round"]
    a, b = _items(round_number, job["point"], job["target"])
    with stdio_server(effects, timeout_s=60) as server:
        agent = Agent.open(
            f"sqlite:///{database}",
            model=_grounded(job),
            system_prompt="You write items.",
            tools=[server],
            memory=False,
        )
        reply = await agent.handle(
            f"round-{round_number}", "u1", job["text"] or f"Write {a} and {b}."
        )
        await agent.aclose()
    statuses = [reply.status]
    if reply.interrupted_turn is not None:
        statuses.append(reply.interrupted_turn.status)
    return {"status": reply.status, "in_doubt": int("tool_in_doubt" in statuses)}


if __name__ == "__main__":
    print(
        json.dumps(
            asyncio.run(_work(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])))
        )
    )
