"""``keel bench mcp``: what keel adds to an MCP tool call, and exactly-once under SIGKILL.

Latency: the same read-only tool (``echo``) of keel's fault server (a real MCP server in its
own process, over stdio) called through the raw SDK client and through keel's executor (look
up, validate against the JSON schema, hop to the connection's loop and back, cap the output),
in interleaved blocks; keel's added time is the difference of the two at p50 and p95.

Exactly-once: ``kills`` times, a worker process (an Agent on a SQLite file, the fault server
over stdio) is SIGKILLed, together with its server, after the server applied a write and
before its answer came back; a new worker process sends the same message (the client's retry):
the write is in doubt and is not run again; the operator settles it from the server's effects.
Counted from the server's own effects file: writes applied twice (doubled), and writes never
applied (missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from mcp import Client, StdioServerParameters
from pydantic import BaseModel

from keel.bench._stats import nearest_rank
from keel.messages import ToolCall
from keel.stores import SQLiteDatabase, SQLiteToolJournal
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
    in_doubt_after_resume: int
    doubled: int
    missing: int
    seconds: float


def run_mcp_bench(calls: int = 500, kills: int = 5) -> MCPBenchReport:
    """Measure ``calls`` calls each way and ``kills`` SIGKILLs mid-write."""
    started = time.perf_counter()
    with TemporaryDirectory(prefix="keel-bench-mcp-") as folder:
        raw, through_keel = asyncio.run(_latencies(Path(folder), calls))
        doubt, doubled, missing = _kill_rounds(Path(folder), kills)
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
        in_doubt_after_resume=doubt,
        doubled=doubled,
        missing=missing,
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


def _kill_rounds(folder: Path, kills: int) -> tuple[int, int, int]:
    """(writes in doubt after the resumes, doubled, missing), counted from the effects."""
    database = folder / "kills.db"
    effects = folder / "effects.txt"
    in_doubt = 0
    for round_number in range(kills):
        item = f"slow:{round_number}"
        worker = _worker(database, effects, round_number)
        _wait_for(lambda item=item: item in _applied(effects), worker)
        os.killpg(worker.pid, signal.SIGKILL)  # the agent and its server, mid-write
        worker.wait()
        resumed = _worker(database, effects, round_number)
        out, _ = resumed.communicate(timeout=120)
        reply = json.loads(out.strip().splitlines()[-1])
        in_doubt += reply["status"] == "tool_in_doubt"
    _settle(database, effects)
    applied = Counter(_applied(effects))
    doubled = sum(1 for count in applied.values() if count > 1)
    missing = sum(1 for n in range(kills) if applied[f"slow:{n}"] == 0)
    return in_doubt, doubled, missing


def _settle(database: Path, effects: Path) -> None:
    """The operator's part: each in-doubt write settled from what the server applied."""
    applied = set(_applied(effects))
    journal = SQLiteToolJournal(SQLiteDatabase(database))
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


def _worker(database: Path, effects: Path, round_number: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "keel.bench.mcp", str(database), str(effects), str(round_number)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: the kill takes its server too
        env={**os.environ, "KEEL_DATA_DIR": str(database.parent / "data")},
    )


async def _work(database: Path, effects: Path, round_number: int) -> dict[str, Any]:
    """One worker's turn: the model writes ``slow:N`` through the fault server."""
    # Only a worker process builds an Agent: the bench's own process measures the executor.
    from keel.runtime import Agent
    from keel.testing import ScriptedModel

    item = f"slow:{round_number}"
    model = ScriptedModel(
        [ScriptedModel.tool_call("write", json.dumps({"item": item})), "Written."]
    )
    with stdio_server(effects, timeout_s=60) as server:
        agent = Agent.open(
            f"sqlite:///{database}",
            model=model,
            system_prompt="You write items.",
            tools=[server],
            memory=False,
        )
        reply = await agent.handle(f"round-{round_number}", "u1", f"Write {item}.")
        await agent.aclose()
    return {"status": reply.status, "error": reply.error}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_work(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))))
