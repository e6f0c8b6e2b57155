"""``keel bench faults``: seeded, randomized faulty runs of the real [`Agent`][].

Every run is a session of an Agent over one SQLite file (its StateStore, the tool journal and
the traces), with the context engine and PII masking as users run it; a scripted model plays
the faulty model. Each run draws one fault: hallucinated tools, invalid or repairable
arguments, endless loops, oscillations, model hangs and errors, cut-off replies, tools that
raise or hang, a booking that outlives its timeout, oversized output, runs that never finish,
a JSON answer where a structured one was wanted, crashes mid-turn. Some are done for real in
other processes:

* ``sigkill_*``: a worker process runs a booking turn and is killed with SIGKILL inside the
  booking tool, or in the model call right after its result; a fresh Agent here finishes the
  turn with [`Agent.resume`][].
* ``two_process``: two worker processes send turns with a booking tool to the *same* session
  at the same time, as two stateless service workers on one database would.

The figures are counted from what happened, not from what the runtime says happened:

* ``double_executions``: business bookings (the order number the scripted customer asked
  for, carried in the tool's arguments) that the *external ledger* (a SQLite table the tool
  writes, outside keel) holds more than once; idempotent calls run again are counted apart.
* ``lost_turns``: user messages that got a reply but are missing from the committed state.
* ``unhandled``: runs that raised (or whose worker died) instead of ending with a reply.
* ``within_limits``: runs whose every turn stayed within its step and wall-clock limits.
* ``state_reverted_on_limit``: runs stopped by a guard whose committed state (read back from
  the store) holds none of the stopped turn's tool calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from keel.bench._fault_world import (
    PLANS,
    Crash,
    Crasher,
    Ledger,
    PlannedModel,
    World,
    booking_policy,
    plan_run,
    worker_tools,
    world_tools,
)
from keel.errors import ConflictError
from keel.guards import GuardConfig
from keel.messages import Message
from keel.models import ChatModel
from keel.runtime import Agent, AgentReply, session_key
from keel.settings import load_settings
from keel.state import AgentState, StateStore
from keel.stores import Backends, StoreName
from keel.testing import ScriptedModel
from keel.tools import Tool, ToolJournal
from keel.tracing import Tracer, TraceStore

__all__ = [
    "FAULTS",
    "FaultBenchReport",
    "KillOutcome",
    "Ledger",
    "PairOutcome",
    "kill_and_resume",
    "resume_after_kill",
    "run_fault_bench",
    "two_processes_one_session",
]

FAULTS = tuple(PLANS)
"""The in-process fault kinds a run can draw (``mixed``: several recoverable ones in a run).
The kinds done in other processes (``sigkill_in_tool``, ``sigkill_next_model_call``,
``two_process``) come on top, as many as ``kills`` and ``pairs`` ask for."""

_GUARDS = GuardConfig(
    max_steps=8,
    run_timeout_s=2.0,
    model_timeout_s=0.1,
    tool_timeout_s=0.1,
    max_output_chars=500,
)
_SLOW_GUARDS = _GUARDS.model_copy(update={"run_timeout_s": 0.15})
_WORKER_GUARDS = GuardConfig(max_steps=8, run_timeout_s=60, model_timeout_s=10)
_TIME_MARGIN_S = 1.0
"""Wall-clock slack over ``run_timeout_s`` for a whole turn (the commit comes after the loop)."""
_USER = "bench-user"
_SYSTEM = "You book flights."
_LIMIT_STATUSES = ("step_limit", "time_limit", "loop_detected")


# --- one keel, as users run it ---------------------------------------------------------------


@dataclass
class _Keel:
    """The stores every Agent of a bench shares: one SQLite file, as ``Agent.embedded``."""

    backends: Backends
    state: StateStore[AgentState]
    journal: ToolJournal | None
    tracer: Tracer
    traces: TraceStore

    @classmethod
    def open(cls, path: Path, *, journal: bool = True) -> _Keel:
        only: tuple[StoreName, ...] = (
            ("state", "journal", "traces") if journal else ("state", "traces")
        )
        backends = Backends.open(
            f"sqlite:///{path}", settings=load_settings(), only=only, redis_url=""
        )
        return cls(
            backends=backends,
            state=backends.state,
            journal=backends.journal if journal else None,
            tracer=Tracer(backends.traces, agent="bench-faults"),
            traces=backends.traces,
        )

    def agent(self, model: ChatModel, tools: list[Tool], guards: GuardConfig) -> Agent:
        """A fresh Agent (a new process, as far as its caches go) on the shared stores."""
        return Agent(
            model,
            state=self.state,
            system_prompt=_SYSTEM,
            tools=tools,
            journal=self.journal,
            tracer=self.tracer,
            guards=guards,
            name="bench-faults",
        )

    @staticmethod
    def key(session: str) -> str:
        """The session's key in the state store (the Agent scopes sessions to their tenant)."""
        return session_key("default", session)

    def repairs(self, run_id: str) -> int:
        return sum(
            1
            for step in self.traces.get_steps(run_id)
            if step.kind == "tool" and (step.attributes or {}).get("repairs")
        )

    def close(self) -> None:
        self.backends.close()


def _turn_messages(state: AgentState, text: str) -> list[Message]:
    """The messages the committed state holds after the (last) user message ``text``."""
    starts = [i for i, m in enumerate(state.messages) if m.role == "user" and m.content == text]
    return list(state.messages[starts[-1] + 1 :]) if starts else []


def _stored_text(agent: Agent, text: str) -> str:
    """The user text as the Agent stores it: masked at the door when masking is on (whatever
    the masker finds in it), so that a turn is looked up by what the state can hold."""
    mask = getattr(getattr(agent, "masker", None), "mask_text", None)
    return str(mask(text, tenant_id=agent.tenant_id)) if callable(mask) else text


def _user_texts(state: AgentState | None) -> Counter[str]:
    if state is None:
        return Counter()
    return Counter(m.content for m in state.messages if m.role == "user")


@dataclass
class _Outcome:
    fault: str
    statuses: list[str]
    raised: str | None
    within_limits: bool
    loops: int
    repairs: int
    limit_hit: bool
    reverted: bool
    effect_hidden: bool
    resumed: bool
    lost_turns: int
    duplicated: int


async def _one_run(index: int, seed: int, keel: _Keel, world: World, tools: list[Tool]) -> _Outcome:
    rng = random.Random(f"{seed}:{index}")
    fault = FAULTS[index % len(FAULTS)] if index < len(FAULTS) else rng.choice(FAULTS)
    session = f"bench-{seed}-{index}"
    plan, settings = plan_run(fault, rng, order=f"o{seed}-{index}")
    crasher = world.crasher = Crasher(where=str(settings.get("crash", "")))
    world.slow_booking = bool(settings.get("slow_booking"))
    guards = _SLOW_GUARDS if settings.get("slow") else _GUARDS

    def fresh_agent() -> Agent:
        model = PlannedModel(list(plan), delay_s=settings.get("delay_s", 0.0), crasher=crasher)
        return keel.agent(model, tools, guards)

    texts = ["Book me a flight to Rome.", *settings.get("more_turns", [])]
    agent = fresh_agent()
    statuses: list[str] = []
    replies: list[tuple[str, AgentReply]] = []
    raised: str | None = None
    resumed = False
    within = True
    limit_hit = reverted = effect_hidden = False
    for text in texts:
        started = time.perf_counter()
        try:
            try:
                reply = await agent.handle(session, _USER, text)
            except Crash:
                # The process died mid-turn: a new one (fresh Agent, fresh model) resumes it.
                within = within and time.perf_counter() - started <= _limit_s(guards)
                resumed = True
                agent = fresh_agent()
                started = time.perf_counter()
                again = await agent.resume(session, _USER)
                if again is None:
                    raise RuntimeError("the crashed turn left no open turn to resume") from None
                reply = again
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
            statuses.append("raised")
            break
        within = (
            within
            and time.perf_counter() - started <= _limit_s(guards)
            and reply.steps <= guards.max_steps
        )
        statuses.append(reply.status)
        stored = _stored_text(agent, text)
        replies.append((stored, reply))
        if reply.status in _LIMIT_STATUSES:
            limit_hit = True
            hit_reverted, hit_hidden = _revert_facts(keel, world, session, stored)
            reverted = reverted or hit_reverted
            effect_hidden = effect_hidden or hit_hidden
    checkpoint = keel.state.get(keel.key(session))
    present = _user_texts(checkpoint.state if checkpoint else None)
    return _Outcome(
        fault=fault,
        statuses=statuses,
        raised=raised,
        within_limits=within and raised is None,
        loops=sum(reply.loops_detected for _, reply in replies),
        repairs=sum(keel.repairs(reply.run_id) for _, reply in replies),
        limit_hit=limit_hit,
        reverted=reverted,
        effect_hidden=effect_hidden,
        resumed=resumed,
        lost_turns=sum(1 for text, _ in replies if present[text] == 0),
        duplicated=sum(count - 1 for count in present.values() if count > 1),
    )


def _limit_s(guards: GuardConfig) -> float:
    return guards.run_timeout_s + _TIME_MARGIN_S


_SIDE_EFFECT_TOOLS = frozenset({"book_flight", "hold_seat"})
"""The bench's side-effecting tools: what a revert keeps in the history."""


def _revert_facts(keel: _Keel, world: World, session: str, text: str) -> tuple[bool, bool]:
    """From the store: did the guard stop revert the turn (no tool call or result of it in the
    committed state, which is the newest checkpoint), and did that hide a booking that the
    ledger says happened?"""
    checkpoint = keel.state.get(keel.key(session))
    if checkpoint is None:
        return False, False
    history = keel.state.history(keel.key(session), limit=1)
    committed = bool(history) and history[0].reason.startswith("turn failed")
    after = _turn_messages(checkpoint.state, text)
    # Reverted: none of the turn's work is left in the committed state but its side effects,
    # which stay there by design (a revert never hides a booking).
    reverted = committed and not any(
        (m.role == "tool" and m.name not in _SIDE_EFFECT_TOOLS)
        or any(call.name not in _SIDE_EFFECT_TOOLS for call in m.tool_calls)
        for m in after
    )
    booked = world.ledger.counts(keel.key(session))
    shown = " ".join(m.content for m in checkpoint.state.messages if m.role == "tool")
    hidden = any(f"order {key}" not in shown for _, key in booked)
    return reverted, hidden


# --- the report ------------------------------------------------------------------------------


class FaultBenchReport(BaseModel):
    """The figures of one ``keel bench faults`` run (see the module docstring for each)."""

    runs: int = Field(description="Runs in all: in process, SIGKILLed workers, process pairs.")
    unhandled: int = Field(description="Runs that raised or whose worker died (target 0).")
    within_limits: int = Field(
        description="Runs whose every turn ended within its step and wall-clock limits (target: "
        "all)."
    )
    double_executions: int = Field(
        description="Business bookings the external ledger holds more than once (target 0)."
    )
    lost_turns: int = Field(
        description="User messages answered but missing from the committed state (target 0)."
    )
    duplicated_user_messages: int = Field(
        description="Extra copies of user messages in the committed state (target 0)."
    )
    missing_effects: int = Field(
        description="Two-process turns that completed but whose booking the ledger lacks."
    )
    conflicted_turns: int = Field(description="Two-process turns that raised ConflictError.")
    conflicted_turns_with_effects: int = Field(
        description="Of those, turns that changed something anyway: booked, or their message "
        "is in the committed state (target 0)."
    )
    loops_detected: int = Field(description="Loop detections (warnings and stops).")
    repairs: int = Field(description="Tool calls whose arguments were repaired and then ran.")
    limit_hits: int = Field(description="Runs stopped by a guard (step, time, loop).")
    state_reverted_on_limit: int = Field(
        description="Of those, runs whose committed state (read from the store) holds none of "
        "the stopped turn's tool calls."
    )
    effects_hidden_by_revert: int = Field(
        description="Runs stopped by a guard whose committed state lost a booking the ledger "
        "holds (target 0)."
    )
    resumed_after_crash: int = Field(description="Runs crashed mid-turn and resumed.")
    killed_subprocesses: int = Field(description="Of those, real workers SIGKILLed.")
    two_process_runs: int = Field(description="Runs of two workers on one session.")
    idempotent_reruns: int = Field(
        description="Idempotent effects the ledger holds more than once (allowed by policy)."
    )
    seconds: float = Field(description="Wall time of the benchmark.")
    by_fault: dict[str, dict[str, int]] = Field(
        description="Per fault kind: runs, and how many turns ended with each status."
    )
    failures: list[str] = Field(description="The first unhandled exceptions, if any.")


def run_fault_bench(
    runs: int = 1000,
    *,
    seed: int = 0,
    kills: int = 4,
    pairs: int = 2,
    pair_turns: int = 6,
    journal: bool = True,
    workdir: Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> FaultBenchReport:
    """Run the benchmark: ``runs`` runs in all; ``kills`` of them a worker SIGKILLed mid-turn
    and resumed here, ``pairs`` of them two workers sending ``pair_turns`` turns each to one
    session; the rest in this process. ``journal=False`` runs the in-process runs without the
    durable journal: the control that shows ``double_executions`` can count doubles."""
    kills = min(kills, runs)
    pairs = min(pairs, runs - kills)
    with _expected_warnings_quiet():
        return _run_fault_bench(runs, seed, kills, pairs, pair_turns, journal, workdir, progress)


@contextlib.contextmanager
def _expected_warnings_quiet() -> Iterator[None]:
    """The injected faults make the guards and tools warn on purpose: quiet them for the run,
    then give the process its logging back (a bench run in-process, by a test or a notebook,
    must not silence later warnings)."""
    loggers = [logging.getLogger(name) for name in ("keel.guards", "keel.tools")]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


def _run_fault_bench(
    runs: int,
    seed: int,
    kills: int,
    pairs: int,
    pair_turns: int,
    journal: bool,
    workdir: Path | None,
    progress: Callable[[int], None] | None,
) -> FaultBenchReport:
    # Load the scripted model's tokenizer before the clock starts: it is a one-off cost.
    ScriptedModel().counter.count_text("warm up")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="keel-bench-faults-") as tmp:
        folder = workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        world = World(ledger=Ledger(folder / "ledger.db"))
        keel = _Keel.open(folder / "keel.db", journal=journal)
        try:
            outcomes = asyncio.run(_all_runs(runs - kills - pairs, seed, keel, world, progress))
            doubles = sum(1 for n in world.ledger.counts().values() if n > 1)
            reruns = sum(1 for n in world.ledger.counts(idempotent=True).values() if n > 1)
        finally:
            # Abandoned booking threads journal their late results: let them finish first.
            for done in world.slow_running:
                done.wait(5)
            time.sleep(0.05)
            keel.close()
        kill_outcomes = [kill_and_resume(folder, i, seed) for i in range(kills)]
        pair_outcomes = [
            two_processes_one_session(folder, i, seed, turns=pair_turns) for i in range(pairs)
        ]
    return _report(outcomes, kill_outcomes, pair_outcomes, doubles, reruns, started)


def _report(
    outcomes: list[_Outcome],
    kills: list[KillOutcome],
    pairs: list[PairOutcome],
    doubles: int,
    reruns: int,
    started: float,
) -> FaultBenchReport:
    by_fault: dict[str, Counter[str]] = defaultdict(Counter)
    failures: list[str] = []
    for outcome in outcomes:
        row = by_fault[outcome.fault]
        row["runs"] += 1
        row.update(outcome.statuses)
        if outcome.raised:
            failures.append(f"{outcome.fault}: {outcome.raised}")
    for kill in kills:
        row = by_fault[f"sigkill_{kill.mode}"]
        row["runs"] += 1
        row[kill.status] += 1
        if kill.error:
            failures.append(f"sigkill_{kill.mode}: {kill.error}")
    for pair in pairs:
        row = by_fault["two_process"]
        row["runs"] += 1
        row.update(pair.statuses)
        failures.extend(f"two_process: {error}" for error in pair.errors)
    return FaultBenchReport(
        runs=len(outcomes) + len(kills) + len(pairs),
        unhandled=sum(1 for o in outcomes if o.raised)
        + sum(1 for k in kills if k.error)
        + sum(1 for p in pairs if p.errors),
        within_limits=sum(1 for o in outcomes if o.within_limits)
        + sum(1 for k in kills if k.error is None)
        + sum(1 for p in pairs if p.within_limits),
        double_executions=doubles + sum(k.doubles for k in kills) + sum(p.doubles for p in pairs),
        lost_turns=sum(o.lost_turns for o in outcomes)
        + sum(k.lost_turns for k in kills)
        + sum(p.lost_turns for p in pairs),
        duplicated_user_messages=sum(o.duplicated for o in outcomes)
        + sum(p.duplicated for p in pairs),
        missing_effects=sum(p.missing_effects for p in pairs),
        conflicted_turns=sum(p.conflicts for p in pairs),
        conflicted_turns_with_effects=sum(p.conflicts_with_effects for p in pairs),
        loops_detected=sum(o.loops for o in outcomes),
        repairs=sum(o.repairs for o in outcomes),
        limit_hits=sum(1 for o in outcomes if o.limit_hit),
        state_reverted_on_limit=sum(1 for o in outcomes if o.reverted),
        effects_hidden_by_revert=sum(1 for o in outcomes if o.effect_hidden),
        resumed_after_crash=sum(1 for o in outcomes if o.resumed) + len(kills),
        killed_subprocesses=len(kills),
        two_process_runs=len(pairs),
        idempotent_reruns=reruns,
        seconds=round(time.perf_counter() - started, 2),
        by_fault={fault: dict(sorted(row.items())) for fault, row in sorted(by_fault.items())},
        failures=failures[:20],
    )


async def _all_runs(
    runs: int,
    seed: int,
    keel: _Keel,
    world: World,
    progress: Callable[[int], None] | None,
) -> list[_Outcome]:
    tools = world_tools(world)
    outcomes: list[_Outcome] = []
    for index in range(runs):
        outcomes.append(await _one_run(index, seed, keel, world, tools))
        if progress is not None:
            progress(index + 1)
    return outcomes


# --- other processes: the booking customer, the worker entry points --------------------------


def _python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


# --- real crashes: a worker SIGKILLed mid-turn, resumed by a fresh Agent here -----------------


@dataclass
class KillOutcome:
    """One real kill-and-resume: how the resumed turn ended and what the ledger holds."""

    mode: str
    status: str
    bookings: int
    doubles: int
    lost_turns: int = 0
    error: str | None = None


def _kill_text(session: str) -> str:
    return f"Please book order {session}."


def _kill_worker(folder: Path, session: str, mode: str) -> None:
    """The process that gets killed: one booking turn, hanging where ``mode`` says."""
    marker = folder / f"{session}.marker"
    keel = _Keel.open(folder / "keel.db")
    model = ScriptedModel(booking_policy(marker if mode == "next_model_call" else None))
    tools = worker_tools(folder, marker if mode == "in_tool" else None)
    agent = keel.agent(model, tools, _WORKER_GUARDS)
    asyncio.run(agent.handle(session, _USER, _kill_text(session)))


def kill_and_resume(folder: Path, number: int, seed: int, *, journal: bool = True) -> KillOutcome:
    """SIGKILL a worker inside the booking (even ``number``) or in the model call after its
    result (odd), then resume the turn with a fresh Agent in this process (without the
    durable journal when ``journal`` is false: the control run)."""
    mode = "in_tool" if number % 2 == 0 else "next_model_call"
    session = f"kill-{seed}-{number}"
    Ledger(folder / "ledger.db")
    marker = folder / f"{session}.marker"
    process = subprocess.Popen(
        [sys.executable, "-m", "keel.bench.faults", "kill-worker", str(folder), session, mode],
        env=_python_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                return KillOutcome(
                    mode,
                    "worker_failed",
                    0,
                    0,
                    error=f"worker did not reach the kill point: {_stderr_tail(process)}",
                )
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        _reap(process)
    return resume_after_kill(folder, session, mode, journal=journal)


def resume_after_kill(
    folder: Path, session: str, mode: str, *, journal: bool = True
) -> KillOutcome:
    """Resume a killed worker's turn with a fresh Agent; count the bookings the ledger holds.
    ``journal=False`` resumes without the durable journal (the control run: it re-books)."""
    keel = _Keel.open(folder / "keel.db", journal=journal)
    try:
        agent = keel.agent(
            ScriptedModel(booking_policy()), worker_tools(folder, None), _WORKER_GUARDS
        )
        stored = _stored_text(agent, _kill_text(session))
        try:
            reply = asyncio.run(agent.resume(session, _USER))
            status: str = reply.status if reply is not None else "nothing_to_resume"
            error = None if reply is not None else "the killed turn left no open turn"
        except Exception as exc:
            status, error = "raised", f"{type(exc).__name__}: {exc}"
        checkpoint = keel.state.get(keel.key(session))
        present = _user_texts(checkpoint.state if checkpoint else None)
    finally:
        keel.close()
    counts = Ledger(folder / "ledger.db").counts(_Keel.key(session))
    return KillOutcome(
        mode=mode,
        status=status,
        bookings=sum(counts.values()),
        doubles=sum(1 for n in counts.values() if n > 1),
        lost_turns=int(present[stored] == 0),
        error=error,
    )


# --- two workers, one session ----------------------------------------------------------------


@dataclass
class PairOutcome:
    """Two workers' turns on one session: what they were told and what the ledger and the
    committed state hold."""

    statuses: list[str]
    doubles: int
    lost_turns: int
    duplicated: int
    missing_effects: int
    conflicts: int
    conflicts_with_effects: int
    within_limits: bool
    errors: list[str]


def _pair_worker(folder: Path, session: str, worker: int, turns: int) -> None:
    """One of the two workers: wait for the start signal, send ``turns`` turns, print what
    each one returned as one JSON line."""
    keel = _Keel.open(folder / "keel.db")
    agent = keel.agent(ScriptedModel(booking_policy()), worker_tools(folder, None), _WORKER_GUARDS)
    (folder / f"{session}.ready{worker}").write_text("ready")
    deadline = time.monotonic() + 60
    while not (folder / f"{session}.go").exists() and time.monotonic() < deadline:
        time.sleep(0.005)

    async def send_all() -> list[dict[str, Any]]:
        results = []
        for turn in range(turns):
            order = f"{session}-w{worker}-t{turn}"
            text = f"Please book order {order}."
            started = time.perf_counter()
            try:
                reply = await asyncio.wait_for(agent.handle(session, _USER, text), 60)
                result: dict[str, Any] = {"status": reply.status, "steps": reply.steps}
            except ConflictError as exc:
                result = {"status": "conflict", "error": str(exc)[:200]}
            except Exception as exc:
                result = {"status": "raised", "error": f"{type(exc).__name__}: {exc}"[:300]}
            result.update(
                order=order,
                text=_stored_text(agent, text),
                seconds=time.perf_counter() - started,
            )
            results.append(result)
        return results

    try:
        print(json.dumps(asyncio.run(send_all())), flush=True)
    finally:
        keel.close()


def two_processes_one_session(
    folder: Path, number: int, seed: int, *, turns: int = 6, timeout_s: float = 120.0
) -> PairOutcome:
    """Two worker processes send ``turns`` booking turns each to one session at once."""
    session = f"pair-{seed}-{number}"
    Ledger(folder / "ledger.db")
    command = [sys.executable, "-m", "keel.bench.faults", "pair-worker", str(folder), session]
    processes = [
        subprocess.Popen(
            [*command, str(worker), str(turns)],
            env=_python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for worker in (0, 1)
    ]
    errors: list[str] = []
    outputs: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        ready = [folder / f"{session}.ready{worker}" for worker in (0, 1)]
        while not all(path.exists() for path in ready):
            if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        (folder / f"{session}.go").write_text("go")
        for process in processes:
            try:
                out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                errors.append(f"a worker did not finish within {timeout_s:g} s")
            if process.returncode not in (0, -signal.SIGKILL):
                errors.append(f"a worker exited with {process.returncode}: {err[-300:]}")
            outputs.append(out)
    finally:
        for process in processes:
            _reap(process)
    turns_seen: list[dict[str, Any]] = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.strip()]
        if lines:
            turns_seen.extend(json.loads(lines[-1]))
    if len(turns_seen) < 2 * turns and not errors:
        errors.append(f"{2 * turns - len(turns_seen)} turns never reported")
    return _pair_figures(folder, session, turns_seen, errors, turns)


def _pair_figures(
    folder: Path, session: str, turns: list[dict[str, Any]], errors: list[str], planned: int
) -> PairOutcome:
    keel = _Keel.open(folder / "keel.db")
    try:
        checkpoint = keel.state.get(keel.key(session))
        present = _user_texts(checkpoint.state if checkpoint else None)
    finally:
        keel.close()
    booked = {
        key: n for (_, key), n in Ledger(folder / "ledger.db").counts(_Keel.key(session)).items()
    }
    replied = [t for t in turns if t["status"] not in ("conflict", "raised")]
    conflicted = [t for t in turns if t["status"] == "conflict"]
    errors = errors + [str(t.get("error")) for t in turns if t["status"] == "raised"]
    within = not errors and all(
        t["seconds"] <= _WORKER_GUARDS.run_timeout_s + _TIME_MARGIN_S
        and int(t.get("steps", 0)) <= _WORKER_GUARDS.max_steps
        for t in turns
    )
    return PairOutcome(
        statuses=[str(t["status"]) for t in turns],
        doubles=sum(1 for n in booked.values() if n > 1),
        lost_turns=sum(1 for t in replied if present[t["text"]] == 0),
        duplicated=sum(count - 1 for count in present.values() if count > 1),
        missing_effects=sum(
            1 for t in replied if t["status"] == "completed" and booked.get(t["order"], 0) == 0
        ),
        conflicts=len(conflicted),
        conflicts_with_effects=sum(
            1 for t in conflicted if booked.get(t["order"], 0) or present[t["text"]]
        ),
        within_limits=within and len(turns) == 2 * planned,
        errors=errors,
    )


def _stderr_tail(process: subprocess.Popen[bytes]) -> str:
    with contextlib.suppress(Exception):
        if process.stderr is not None:
            return process.stderr.read().decode(errors="replace")[-300:]
    return ""


def _reap(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m keel.bench.faults")
    commands = parser.add_subparsers(dest="command", required=True)
    kill = commands.add_parser("kill-worker")
    kill.add_argument("folder", type=Path)
    kill.add_argument("session")
    kill.add_argument("mode", choices=["in_tool", "next_model_call"])
    pair = commands.add_parser("pair-worker")
    pair.add_argument("folder", type=Path)
    pair.add_argument("session")
    pair.add_argument("worker", type=int)
    pair.add_argument("turns", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.command == "kill-worker":
        _kill_worker(args.folder, args.session, args.mode)
    else:
        _pair_worker(args.folder, args.session, args.worker, args.turns)


if __name__ == "__main__":
    _main(sys.argv[1:])
