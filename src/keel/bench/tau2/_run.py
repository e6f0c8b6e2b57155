"""One task of ``keel bench tau2``: the conversation between the scripted customer and a keel
Agent (the grounded oracle as its model, the τ² server's tools through MCP), in one of the
bench's modes, and its score from the server's own records."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.bench.tau2._customer import GO_ON, YES, first_message, next_message
from keel.bench.tau2._data import (
    PACKAGE,
    PLACEHOLDER_ARG,
    WRITE_TOOLS,
    Task,
    load_policy,
    load_tasks,
    read_state,
    state_key,
)
from keel.bench.tau2._oracle import GroundedOracle
from keel.bench.tau2._tools import call_log, retail_server, run_calls
from keel.guards import GuardConfig
from keel.messages import Message
from keel.privacy import MasterKey
from keel.privacy._keys import write_key_file
from keel.runtime import Agent, AgentReply
from keel.settings import load_settings
from keel.state import AgentState
from keel.testing import ScriptedCall
from keel.tools import MCPServer

__all__ = ["MODES", "TaskOutcome", "gold_db", "run_task", "score"]

MODES = ("clean", "kill", "timeout", "duplicate")
USER = "customer"
DOMAIN = "retail"
_GUARDS = GuardConfig(
    max_steps=60,
    run_timeout_s=300,
    model_timeout_s=60,
    tool_timeout_s=60,
    max_output_chars=200_000,
    # The gold calls of a task may fail a few times in a row (a wrong id the customer gave).
    max_tool_retries=6,
)
_TIMEOUT_S = 0.5
"""A write's timeout in the timeout mode; the proxy holds its answer for `_HELD_S`."""
_HELD_S = 1.5
_ATTEMPTS = 4
"""Processes a killed task may take before it counts as failed."""


@dataclass
class TaskOutcome:
    """One task in one mode: scored as τ² scores it, counted from the server's call log."""

    task: str
    db_match: bool
    doubled_writes: int
    missing_writes: int
    placeholder_args: int
    ungrounded: int
    fault: str = ""
    error: str | None = None
    statuses: list[str] = field(default_factory=list)

    @property
    def settled(self) -> int:
        """In-doubt writes an operator settled from the server's call log."""
        return self.statuses.count("settled")


def _folder_files(folder: Path) -> tuple[Path, Path]:
    return folder / "keel.db", folder / "state"


def _pii_key(folder: Path) -> Path:
    """The run's PII master key, in a file as a deployment keeps one (``KEEL_PII_KEY_FILE``):
    every process of the run opens the same vault with it."""
    path = folder / "pii.key"
    if not path.exists():
        write_key_file(path, MasterKey.new_key_text())
    return path


def _agent(folder: Path, oracle: GroundedOracle, server: MCPServer) -> Agent:
    database, _ = _folder_files(folder)
    return Agent.open(
        f"sqlite:///{database}",
        settings=load_settings(pii_key_file=_pii_key(folder)),
        system_prompt=load_policy(DOMAIN),
        model=oracle,
        memory=False,
        tools=[server],
        guards=_GUARDS,
        name="bench-tau2",
    )


class _DyingOracle(GroundedOracle):
    """The oracle of a process the kill mode SIGKILLs at its ``die_at``th model call: a crash
    between steps (keel checkpoints before each model call)."""

    die_at = 0

    def decide(self, call: ScriptedCall) -> Message | str:
        if len(self.calls) == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().decide(call)


def _oracle(task: Task, folder: Path, session: str, *, die_at: int = 0) -> GroundedOracle:
    texts = [first_message(task), YES, GO_ON]
    oracle = _DyingOracle(task, texts, record=folder / f"{session}.ungrounded")
    oracle.die_at = die_at
    return oracle


def _last_answer(state: AgentState | None) -> str | None:
    if state is None:
        return None
    for message in reversed(state.messages):
        if message.role == "assistant" and not message.tool_calls:
            return message.content
    return ""


async def converse(
    agent: Agent,
    task: Task,
    session: str,
    *,
    duplicate: bool = False,
    settle: Callable[[Agent, str], Awaitable[int]] | None = None,
) -> list[str]:
    """Carry the conversation on from where the session is (a new process resumes the open
    turn first) until the agent's last answer; the turns' statuses."""
    statuses: list[str] = []
    resumed = await agent.resume(session, USER)
    if resumed is not None:
        statuses.append(f"resumed:{resumed.status}")
        if resumed.status == "tool_in_doubt" and settle is not None:
            statuses.extend(["settled"] * await settle(agent, session))
    state = agent.session_state(session)
    last = _last_answer(state)
    message = (
        first_message(task) if last is None else next_message(resumed.text if resumed else last)
    )
    turns = sum(1 for m in state.messages if m.role == "user") if state else 0
    while message is not None and turns < 2 * len(task.actions) + 8:
        turn_id = f"{session}-t{turns}"
        reply = await _deliver(agent, session, message, turn_id, twice=duplicate and message == YES)
        statuses.append(reply.status)
        turns += 1
        if reply.status == "tool_in_doubt" and settle is not None:
            statuses.extend(["settled"] * await settle(agent, session))
        message = next_message(reply.text)
    return statuses


async def _deliver(
    agent: Agent, session: str, text: str, turn_id: str, *, twice: bool
) -> AgentReply:
    if not twice:
        return await agent.run(text, session=session, user=USER, turn_id=turn_id)
    # An HTTP retry: the same message with the same turn id, while the first is in flight.
    first, second = await asyncio.gather(
        agent.run(text, session=session, user=USER, turn_id=turn_id),
        agent.run(text, session=session, user=USER, turn_id=turn_id),
    )
    return first if not first.replayed else second


def settle_from_call_log(state_dir: Path, key: str) -> Callable[[Agent, str], Awaitable[int]]:
    """What an operator does with a write left in doubt: look it up in the server's own call
    log and record what really happened (``keel tools resolve``'s API)."""

    async def settle(agent: Agent, session: str) -> int:
        journal = agent.journal
        if journal is None:
            return 0
        calls = await call_log(state_dir, key)
        entries = journal.in_doubt(agent.session_key(session))
        for entry in entries:
            # The journal keeps the arguments masked; the operator, granted the user's values,
            # reads them as the server got them (as `GET /v1/sessions/{id}/in-doubt` shows
            # them to an operator key granted values).
            shown = entry.arguments
            if agent.vault is not None:
                shown = agent.vault.user(agent.tenant_id, USER).reveal(shown)
            arguments = json.loads(shown)
            done = [
                c
                for c in calls
                if c["tau2_tool_call"]["name"] == entry.tool
                and c["tau2_tool_call"]["arguments"] == arguments
            ]
            if done:
                message = done[-1]["tau2_tool_message"]
                journal.resolve(entry.key, ok=not message["error"], content=str(message["content"]))
            else:
                journal.resolve(
                    entry.key, ok=False, content="Error: the store has no record of this call."
                )
        return len(entries)

    return settle


async def _run_here(task: Task, folder: Path, mode: str, key: str, fault: list[str]) -> list[str]:
    session = f"{mode}-{task.id}"
    _, state_dir = _folder_files(folder)
    timeout = _TIMEOUT_S if mode == "timeout" else 30.0
    with retail_server(state_dir, key, fault=fault, write_timeout_s=timeout) as server:
        agent = _agent(folder, _oracle(task, folder, session), server)
        try:
            return await converse(
                agent,
                task,
                session,
                duplicate=mode == "duplicate",
                settle=settle_from_call_log(state_dir, key),
            )
        finally:
            await agent.aclose()


def run_task(task: Task, folder: Path, mode: str, kill_point: str = "") -> TaskOutcome:
    """Run ``task`` in ``mode`` on the stores in ``folder``; score it against the gold db."""
    key = state_key(DOMAIN, task.id, mode)
    statuses: list[str] = []
    error = None
    fault: list[str] = []
    if mode == "timeout" and task.writes:
        fault = ["--delay-write", "1", "--delay-s", str(_HELD_S)]
    try:
        if mode == "kill":
            statuses = _run_killed(task, folder, kill_point)
        else:
            statuses = asyncio.run(_run_here(task, folder, mode, key, fault))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return score(task, folder, key, statuses, error, fault=kill_point or " ".join(fault))


def _run_killed(task: Task, folder: Path, kill_point: str) -> list[str]:
    """The task in worker processes: the first is SIGKILLed at ``kill_point`` (``write:N``
    inside the Nth write once the server applied it, ``step:K`` at the Kth model call), each
    next one continues the session."""
    statuses: list[str] = []
    for attempt in range(_ATTEMPTS):
        point = kill_point if attempt == 0 else ""
        command = [sys.executable, "-m", "keel.bench.tau2", "worker", str(folder), task.id, point]
        done = subprocess.run(
            command,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode == 0:
            statuses.extend(json.loads(done.stdout.strip().splitlines()[-1]))
            return statuses
        if done.returncode != -signal.SIGKILL:
            raise RuntimeError(f"worker exited with {done.returncode}: {done.stderr[-400:]}")
        statuses.append("killed")
    raise RuntimeError(f"the task did not finish in {_ATTEMPTS} processes")


def worker(folder: Path, task_id: str, kill_point: str, split: str = "all") -> None:
    """A process of the kill mode: continue the task's session, dying where told."""
    logging.basicConfig(level=logging.ERROR)
    task = next(t for t in load_tasks(DOMAIN, split) if t.id == task_id)
    session = f"kill-{task.id}"
    key = state_key(DOMAIN, task.id, "kill")
    _, state_dir = _folder_files(folder)
    kind, _, number = kill_point.partition(":")
    fault = ["--kill-after-write", number] if kind == "write" else []
    oracle = _oracle(task, folder, session, die_at=int(number) if kind == "step" else 0)

    async def go() -> list[str]:
        with retail_server(state_dir, key, fault=fault) as server:
            agent = _agent(folder, oracle, server)
            try:
                return await converse(
                    agent, task, session, settle=settle_from_call_log(state_dir, key)
                )
            finally:
                await agent.aclose()

    print(json.dumps(asyncio.run(go())), flush=True)


# --- the score -------------------------------------------------------------------------------


def gold_db(task: Task, folder: Path) -> dict[str, Any]:
    """The database the task's gold calls produce (run on the same server, in its own
    namespace), as τ²-bench computes it."""
    _, state_dir = _folder_files(folder)
    key = state_key(DOMAIN, task.id, "gold")
    state = read_state(state_dir, key)
    if state is None:
        asyncio.run(_run_gold(task, state_dir, key))
        state = read_state(state_dir, key)
    return _base_db() if state is None else state["db"]


def _base_db() -> dict[str, Any]:
    # The package's own loader of its database (the bench extra).
    server = importlib.import_module(f"{PACKAGE}.server")
    db: dict[str, Any] = server._base_db()
    return db


async def _run_gold(task: Task, state_dir: Path, key: str) -> None:
    await run_calls(state_dir, key, [(a.name, a.arguments) for a in task.actions])


def _canonical(name: str, arguments: dict[str, Any]) -> str:
    return name + json.dumps(arguments, sort_keys=True)


def _write(call: dict[str, Any]) -> str | None:
    tool_call = call["tau2_tool_call"]
    if tool_call["name"] not in WRITE_TOOLS:
        return None
    return _canonical(tool_call["name"], tool_call["arguments"])


def _applied_writes(calls: list[dict[str, Any]]) -> Counter[str]:
    """The writes the server applied, from its call log (a rejected one changed nothing)."""
    return Counter(key for c in calls if (key := _write(c)) and not c["tau2_tool_message"]["error"])


def _doubled_writes(calls: list[dict[str, Any]], gold: Counter[str]) -> int:
    """Writes that reached the server again after it had applied them (as often as the gold
    calls apply them): what exactly-once forbids. A write the server rejected may be sent
    again once an operator found it changed nothing."""
    applied: Counter[str] = Counter()
    doubled = 0
    for call in calls:
        key = _write(call)
        if key is None:
            continue
        if applied[key] >= max(gold[key], 1):
            doubled += 1
        if not call["tau2_tool_message"]["error"]:
            applied[key] += 1
    return doubled


def score(
    task: Task, folder: Path, key: str, statuses: list[str], error: str | None, *, fault: str
) -> TaskOutcome:
    _, state_dir = _folder_files(folder)
    expected = gold_db(task, folder)
    # No state: the agent never called the server, and the store is as it started.
    state = read_state(state_dir, key) or {"db": _base_db(), "calls": []}
    gold_state = read_state(state_dir, state_key(DOMAIN, task.id, "gold")) or {"calls": []}
    calls = [c["tau2_tool_call"] for c in state["calls"]]
    made = _applied_writes(state["calls"])
    gold = _applied_writes(gold_state["calls"])
    record = folder / f"{key.split('/')[-1]}-{task.id}.ungrounded"
    ungrounded = set(record.read_text().split()) if record.exists() else set()
    return TaskOutcome(
        task=task.id,
        db_match=state["db"] == expected,
        doubled_writes=_doubled_writes(state["calls"], gold),
        missing_writes=sum(max(0, n - made[k]) for k, n in gold.items()),
        placeholder_args=sum(
            1 for c in calls if PLACEHOLDER_ARG.search(json.dumps(c["arguments"]))
        ),
        ungrounded=len(ungrounded),
        fault=fault,
        error=error,
        statuses=statuses,
    )
