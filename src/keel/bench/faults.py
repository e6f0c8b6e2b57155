"""``keel bench faults``: thousands of seeded, randomized faulty runs of the tool loop.

Each run draws one fault (hallucinated tools, invalid or repairable arguments, endless loops,
oscillations, model hangs and errors, cut-off replies, tools that raise or hang, oversized
output, runs that never finish, invalid structured output, crashes mid-tool-call) and mixes in
valid calls. A scripted model plays the faulty model; the real tool loop, executor, guards and
SQLite journal do the rest. Crashes are simulated in process (the run is abandoned after the
intent is journalled and resumed by a fresh loop on the same journal) and, a few times, done
for real: a subprocess is killed with SIGKILL mid-tool-call and this process resumes its run.

The figures: runs that raised (must be 0), runs that ended within their step and time limits
(must be all), loops detected, repaired arguments, side-effecting calls executed more than once
per idempotency key (must be 0), and runs whose state was reverted when a limit was hit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from keel.errors import GuardError, ModelUnavailableError
from keel.guards import GuardConfig, SpiralMonitor
from keel.messages import Message, Usage
from keel.models import Completion, ModelOptions, ToolSchema
from keel.runtime import LoopHooks, LoopResult, StepRecord, ToolLoop
from keel.stores import SQLiteDatabase, SQLiteToolJournal
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, ToolContext, ToolJournal, ToolRegistry, tool

__all__ = [
    "FAULTS",
    "FaultBenchReport",
    "KillOutcome",
    "kill_and_resume",
    "resume_after_kill",
    "run_fault_bench",
]

FAULTS = (
    "clean",
    "hallucinated_tool",
    "invalid_arguments",
    "repairable_arguments",
    "endless_loop",
    "oscillation",
    "model_hang",
    "model_error",
    "truncated_reply",
    "tool_raises",
    "tool_hang",
    "oversized_output",
    "never_finishes",
    "slow_run",
    "structured_output",
    "crash_resume",
    "mixed",
)
"""The fault kinds a run can draw (``mixed``: several of the recoverable ones in one run)."""

_GUARDS = GuardConfig(
    max_steps=8,
    run_timeout_s=2.0,
    model_timeout_s=0.1,
    tool_timeout_s=0.1,
    max_output_chars=500,
)
_SLOW_GUARDS = _GUARDS.model_copy(update={"run_timeout_s": 0.15})
_TIME_MARGIN_S = 0.5
_FINAL = "Here is what I found for you."
_HANG = "hang"
_HANG_ONCE = "hang_once"
_CITIES = ("Paris", "Lyon", "Oslo", "Rome", "Lima", "Kyiv", "Doha", "Baku", "Riga", "Bern", "Nice")


class _Crash(BaseException):
    """Simulates the process dying: not an Exception, so nothing in keel catches it."""


class Answer(BaseModel):
    """The structured answer of the structured-output fault."""

    flight: str = Field(description="Flight number.")
    seats: int = Field(description="Seats booked.")


@dataclass
class _Ledger:
    """The 'outside world': how often each side-effecting call really ran, per key."""

    executions: Counter[str] = field(default_factory=Counter)
    idempotent: set[str] = field(default_factory=set)

    def record(self, context: ToolContext | None, *, idempotent: bool) -> None:
        if context is None:
            return
        self.executions[context.idempotency_key] += 1
        if idempotent:
            self.idempotent.add(context.idempotency_key)

    def doubles(self) -> int:
        return sum(
            1 for key, count in self.executions.items() if count > 1 and key not in self.idempotent
        )

    def idempotent_reruns(self) -> int:
        return sum(
            1 for key, count in self.executions.items() if count > 1 and key in self.idempotent
        )


@dataclass
class _Crasher:
    """Arms one simulated crash: where, and whether it already happened."""

    where: str = ""
    fired: bool = False

    def maybe(self, where: str) -> None:
        if self.where == where and not self.fired:
            self.fired = True
            raise _Crash(where)


@dataclass
class _World:
    """What the bench tools act on: the ledger, and the crash armed for the current run."""

    ledger: _Ledger = field(default_factory=_Ledger)
    crasher: _Crasher = field(default_factory=_Crasher)


def _tools(world: _World) -> list[Tool]:
    @tool
    def search_flights(origin: str, destination: str, date: str = "2026-12-01") -> str:
        """Find flights between two cities.

        Args:
            origin: City the trip starts from.
            destination: City the trip goes to.
            date: Day of travel, YYYY-MM-DD.
        """
        return json.dumps([{"flight": f"KL{len(origin) * 100 + len(destination)}", "date": date}])

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city.
        """
        return f"{city}: {len(city) * 3} C, clear"

    @tool(side_effect=True, idempotent=False)
    def book_flight(flight: str, passengers: int, ctx: ToolContext | None = None) -> str:
        """Book seats on a flight (charges the card).

        Args:
            flight: Flight number.
            passengers: Number of seats.
        """
        world.ledger.record(ctx, idempotent=False)
        world.crasher.maybe("book_flight")
        return f"booked {passengers} seat(s) on {flight}, reference BK{abs(hash(flight)) % 9999}"

    @tool(side_effect=True, idempotent=True)
    def hold_seat(flight: str, seat: str, ctx: ToolContext | None = None) -> str:
        """Hold a seat (holding twice is harmless).

        Args:
            flight: Flight number.
            seat: Seat, e.g. 12A.
        """
        world.ledger.record(ctx, idempotent=True)
        world.crasher.maybe("hold_seat")
        return f"seat {seat} held on {flight}"

    @tool
    def flaky_lookup(code: int) -> str:
        """Look up a booking code.

        Args:
            code: The numeric code.
        """
        raise ValueError(f"booking service unavailable for code {code}")

    @tool
    async def slow_report(seconds: float) -> str:
        """Build a report (slow).

        Args:
            seconds: How long the report takes.
        """
        await asyncio.sleep(seconds)
        return "report"

    @tool
    def export_history(lines: int) -> str:
        """Export the booking history.

        Args:
            lines: Number of lines.
        """
        return "\n".join(f"line {i}: booking record with some padding text" for i in range(lines))

    return [
        search_flights,
        get_weather,
        book_flight,
        hold_seat,
        flaky_lookup,
        slow_report,
        export_history,
    ]


def _call(name: str, arguments: Any) -> Message:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ScriptedModel.tool_call(name, raw)


def _valid(rng: random.Random) -> Message:
    if rng.random() < 0.5:
        return _call("get_weather", {"city": rng.choice(_CITIES)})
    origin, destination = rng.sample(_CITIES, 2)
    return _call("search_flights", {"origin": origin, "destination": destination})


def _truncated(kind: str) -> Completion:
    texts = {
        "length": "The flights I found are",
        "fence": "Here is the code:\n```python\nprint(",
        "json": '{"answer": "KL123", "seats": ',
        "dangling": "The cheapest flight leaves at noon and",
        "empty": "",
    }
    return Completion(
        message=Message.assistant(texts[kind]),
        finish_reason="length" if kind == "length" else "stop",
        usage=Usage(prompt_tokens=50, completion_tokens=10),
        model="scripted",
        latency_ms=1.0,
    )


_REPAIRABLE = (
    '```json\n{"flight": "KL7", "passengers": 2}\n```',
    "{'flight': 'KL7', 'passengers': 2}",
    '{"flight": "KL7", "passengers": 2,}',
    '{"flight": "KL7", "passengers": "2"}',
    'Sure! {"flight": "KL7", "passengers": 2}',
    "{'flight': 'KL7', 'passengers': 2, }",
)
_INVALID = (
    '{"flight": "KL7", "passengers": "two"}',
    '{"flight": "KL7"}',
    '{"flight": "KL7", "passengers": 2, "seat_class": "gold"}',
    '{"flight": "KL7", "passengers": 2.5}',
    '{"flight": "KL7", "passengers":',
    "[1, 2]",
)


def _plan(fault: str, rng: random.Random) -> tuple[list[Any], dict[str, Any]]:
    """The script of a run (one reply per model call) and per-run settings."""
    lead: list[Any] = [_valid(rng) for _ in range(rng.randint(0, 2))]
    settings: dict[str, Any] = {}
    plan: list[Any]
    if fault == "clean":
        plan = [*lead, _call("book_flight", {"flight": "KL7", "passengers": 1}), _FINAL]
    elif fault == "hallucinated_tool":
        wrong = [
            _call(rng.choice(["serch_flights", "book_flite", "weather", "bookFlight"]), "{}")
            for _ in range(rng.choice([1, 1, 2, 4]))
        ]
        plan = [*lead, *wrong, _call("get_weather", {"city": "Oslo"}), _FINAL]
    elif fault == "invalid_arguments":
        bad = [_call("book_flight", rng.choice(_INVALID)) for _ in range(rng.choice([1, 1, 2, 4]))]
        plan = [*lead, *bad, _call("book_flight", {"flight": "KL7", "passengers": 2}), _FINAL]
    elif fault == "repairable_arguments":
        plan = [*lead, _call("book_flight", rng.choice(_REPAIRABLE)), _FINAL]
    elif fault == "endless_loop":
        plan = [*lead, _call("get_weather", {"city": "Paris"})]
    elif fault == "oscillation":
        a = _call("get_weather", {"city": "Paris"})
        b = _call("search_flights", {"origin": "Paris", "destination": "Rome"})
        plan = [*lead, *([a, b] * 10)]
    elif fault == "model_hang":
        hang = _HANG if rng.random() < 0.3 else _HANG_ONCE
        plan = [*lead, hang, _call("get_weather", {"city": "Rome"}), _FINAL]
    elif fault == "model_error":
        persistent = rng.random() < 0.3
        error = ModelUnavailableError("provider returned 503", model="scripted", attempts=3)
        plan = [*lead, error, error if persistent else _FINAL, _FINAL]
    elif fault == "truncated_reply":
        kind = rng.choice(["length", "fence", "json", "dangling", "empty"])
        again = rng.random() < 0.3
        plan = [*lead, _truncated(kind), _truncated(kind) if again else _FINAL, _FINAL]
    elif fault == "tool_raises":
        plan = [
            *lead,
            *[_call("flaky_lookup", {"code": 100 + i}) for i in range(rng.choice([1, 2, 3, 4]))],
            _FINAL,
        ]
    elif fault == "tool_hang":
        plan = [*lead, _call("slow_report", {"seconds": 30}), _FINAL]
    elif fault == "oversized_output":
        plan = [*lead, _call("export_history", {"lines": rng.randint(200, 2000)}), _FINAL]
    elif fault == "never_finishes":
        plan = [_call("get_weather", {"city": f"{city} {i}"}) for i, city in enumerate(_CITIES * 3)]
    elif fault == "slow_run":
        plan = [_call("get_weather", {"city": f"{city} {i}"}) for i, city in enumerate(_CITIES * 3)]
        settings["delay_s"] = 0.03
        settings["guards"] = _SLOW_GUARDS
    elif fault == "structured_output":
        wrong_answer = rng.choice(
            ['{"flight": "KL7"}', '{"flight": "KL7", "seats": "many"}', "KL7, 2 seats"]
        )
        good = '{"flight": "KL7", "seats": 2}'
        plan = [*lead, wrong_answer, wrong_answer if rng.random() < 0.3 else good, good]
        settings["output_schema"] = Answer
    elif fault == "crash_resume":
        where = rng.choice(["book_flight", "book_flight", "hold_seat", "after_step"])
        settings["crash"] = where
        if where == "hold_seat":
            action = _call("hold_seat", {"flight": "KL7", "seat": "12A"})
        else:
            action = _call("book_flight", {"flight": "KL7", "passengers": 2})
        plan = [*lead, action, _FINAL]
    elif fault == "mixed":
        fragments: list[list[Any]] = [
            [_call(rng.choice(["serch_flights", "weather"]), "{}")],
            [_call("book_flight", rng.choice(_REPAIRABLE))],
            [
                _call("book_flight", rng.choice(_INVALID)),
                _call("book_flight", {"flight": "KL8", "passengers": 1}),
            ],
            [_call("flaky_lookup", {"code": rng.randint(1, 99)})],
            [_call("export_history", {"lines": 300})],
            [_call("slow_report", {"seconds": 30})],
            [_truncated(rng.choice(["length", "fence", "empty"]))],
            [_valid(rng)],
        ]
        chosen = rng.sample(fragments, rng.randint(2, 3))
        plan = [*lead, *[reply for fragment in chosen for reply in fragment], _FINAL]
    else:  # pragma: no cover - FAULTS is exhaustive
        raise ValueError(fault)
    return plan, settings


class _PlannedModel(ScriptedModel):
    """A scripted model whose replies follow a plan indexed by the conversation's progress.

    The position is the number of replies the conversation already holds (assistant messages,
    plus the corrections that replaced unusable replies), so a resumed run (fresh model,
    restored messages) continues exactly where the crashed one stopped. Replies that leave no
    message (``hang_once``, exceptions) are consumed from the plan when used; ``hang`` stays.
    """

    def __init__(self, plan: list[Any], *, delay_s: float = 0.0) -> None:
        self.plan = plan
        super().__init__(self._reply, delay_s=delay_s)

    def _index(self, messages: Sequence[Message]) -> int:
        replies = sum(
            1
            for m in messages
            if m.role == "assistant" or m.metadata.get("keel_correction") in ("truncated", "empty")
        )
        return min(replies, len(self.plan) - 1)

    def _reply(self, call: ScriptedCall) -> Any:
        return self.plan[self._index(call.messages)]

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        position = self._index(messages)
        reply = self.plan[position]
        if isinstance(reply, BaseException) or reply == _HANG_ONCE:
            self.plan = [*self.plan[:position], *self.plan[position + 1 :]]
        if isinstance(reply, BaseException):
            raise reply
        if reply in (_HANG, _HANG_ONCE):
            await asyncio.sleep(3600)
        return await super()._acomplete(messages, tools, options)


@dataclass
class _Outcome:
    fault: str
    status: str
    raised: str | None
    within_limits: bool
    loops: int
    repairs: int
    reverted: bool
    limit_hit: bool
    resumed: bool


async def _one_run(
    index: int, seed: int, journal: ToolJournal, world: _World, registry: ToolRegistry
) -> _Outcome:
    rng = random.Random(f"{seed}:{index}")
    fault = FAULTS[index % len(FAULTS)] if index < len(FAULTS) else rng.choice(FAULTS)
    plan, settings = _plan(fault, rng)
    crasher = world.crasher = _Crasher(where=str(settings.get("crash", "")))
    guards: GuardConfig = settings.get("guards", _GUARDS)
    session = f"bench-{seed}-{index}"
    checkpoints: list[tuple[int, list[Message]]] = []
    reverts: list[GuardError] = []
    step_counts: list[int] = []

    def before_model_call(step: int, messages: list[Message]) -> None:
        checkpoints.append((step, list(messages)))

    def after_step(record: StepRecord) -> None:
        step_counts[-1] += 1
        if any(result.tool == "book_flight" and result.ok for result in record.tool_results):
            crasher.maybe("after_step")

    hooks = LoopHooks(
        before_model_call=before_model_call,
        after_step=after_step,
        revert_to_last_good=reverts.append,
    )

    def make_loop() -> ToolLoop:
        model = _PlannedModel(list(plan), delay_s=settings.get("delay_s", 0.0))
        return ToolLoop(
            model,
            registry,
            guards=guards,
            journal=journal,
            hooks=hooks,
            monitor=SpiralMonitor(),
            output_schema=settings.get("output_schema"),
        )

    messages = [Message.system("You book flights."), Message.user("Book me a flight to Rome.")]
    resumed = False
    raised: str | None = None
    result: LoopResult | None = None
    durations: list[float] = []
    started = time.perf_counter()
    step_counts.append(0)
    try:
        result = await make_loop().arun(messages, session_id=session)
    except _Crash:
        durations.append(time.perf_counter() - started)
        resumed = True
        step, restored = checkpoints[-1]
        step_counts.append(0)
        started = time.perf_counter()
        try:
            result = await make_loop().arun(restored, session_id=session, first_step=step)
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    durations.append(time.perf_counter() - started)
    within = all(count <= guards.max_steps for count in step_counts) and all(
        duration <= guards.run_timeout_s + _TIME_MARGIN_S for duration in durations
    )
    status = result.status if result is not None else "raised"
    limit_hit = status in ("step_limit", "time_limit", "loop_detected")
    return _Outcome(
        fault=fault,
        status=status,
        raised=raised,
        within_limits=within and result is not None,
        loops=result.loops_detected if result is not None else 0,
        repairs=result.repairs if result is not None else 0,
        reverted=bool(reverts) and limit_hit,
        limit_hit=limit_hit,
        resumed=resumed,
    )


class FaultBenchReport(BaseModel):
    """The figures of one ``keel bench faults`` run."""

    runs: int = Field(description="Runs in all, the SIGKILLed subprocess runs included.")
    unhandled_exceptions: int = Field(description="Runs that raised instead of ending (target 0).")
    ended_within_limits: int = Field(
        description="Runs that ended within their step limit and wall-clock limit (target: all)."
    )
    loops_detected: int = Field(description="Loop detections (warnings and stops).")
    repairs: int = Field(description="Tool calls whose arguments were repaired and then ran.")
    double_executions: int = Field(
        description="Non-idempotent side-effecting calls that ran twice for one key (target 0)."
    )
    state_reverted_on_limit: int = Field(
        description="Runs stopped by a guard whose revert_to_last_good hook was called."
    )
    limit_hits: int = Field(description="Runs stopped by a guard (step, time, loop).")
    resumed_after_crash: int = Field(description="Runs crashed mid-tool-call and resumed.")
    killed_subprocesses: int = Field(description="Of those, real subprocesses SIGKILLed.")
    idempotent_reruns: int = Field(
        description="In-doubt idempotent calls run again on resume (allowed by their policy)."
    )
    seconds: float = Field(description="Wall time of the benchmark.")
    by_fault: dict[str, dict[str, int]] = Field(
        description="Per fault kind: runs, and how many ended with each status."
    )
    failures: list[str] = Field(description="The first unhandled exceptions, if any.")


def run_fault_bench(
    runs: int = 1000,
    *,
    seed: int = 0,
    kills: int = 3,
    workdir: Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> FaultBenchReport:
    """Run the benchmark: ``runs`` runs in all, ``kills`` of them in a real subprocess that is
    killed with SIGKILL mid-tool-call and resumed here; the rest in process."""
    kills = min(kills, runs)
    logging.getLogger("keel.guards").setLevel(logging.ERROR)
    # Load the scripted model's tokenizer before the clock starts: it is a one-off cost.
    ScriptedModel().counter.count_text("warm up")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="keel-bench-faults-") as tmp:
        folder = workdir or Path(tmp)
        db = SQLiteDatabase(folder / "journal.db")
        try:
            journal = SQLiteToolJournal(db)
            world = _World()
            outcomes = asyncio.run(_all_runs(runs - kills, seed, journal, world, progress))
        finally:
            db.close()
        kill_outcomes = [kill_and_resume(folder, i, seed) for i in range(kills)]
    by_fault: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    failures: list[str] = []
    for outcome in outcomes:
        row = by_fault[outcome.fault]
        row["runs"] += 1
        row[outcome.status] += 1
        if outcome.raised:
            failures.append(f"{outcome.fault}: {outcome.raised}")
    double = world.ledger.doubles()
    kill_row = by_fault["sigkill_resume"]
    for kill in kill_outcomes:
        kill_row["runs"] += 1
        kill_row[kill.status] += 1
        double += kill.doubles
        if kill.error:
            failures.append(f"sigkill_resume: {kill.error}")
    if not kill_outcomes:
        del by_fault["sigkill_resume"]
    return FaultBenchReport(
        runs=len(outcomes) + len(kill_outcomes),
        unhandled_exceptions=sum(1 for o in outcomes if o.raised)
        + sum(1 for k in kill_outcomes if k.error),
        ended_within_limits=sum(1 for o in outcomes if o.within_limits)
        + sum(1 for k in kill_outcomes if k.error is None),
        loops_detected=sum(o.loops for o in outcomes),
        repairs=sum(o.repairs for o in outcomes),
        double_executions=double,
        state_reverted_on_limit=sum(1 for o in outcomes if o.reverted),
        limit_hits=sum(1 for o in outcomes if o.limit_hit),
        resumed_after_crash=sum(1 for o in outcomes if o.resumed) + len(kill_outcomes),
        killed_subprocesses=len(kill_outcomes),
        idempotent_reruns=world.ledger.idempotent_reruns(),
        seconds=round(time.perf_counter() - started, 2),
        by_fault={fault: dict(sorted(row.items())) for fault, row in sorted(by_fault.items())},
        failures=failures[:20],
    )


async def _all_runs(
    runs: int,
    seed: int,
    journal: ToolJournal,
    world: _World,
    progress: Callable[[int], None] | None,
) -> list[_Outcome]:
    registry = ToolRegistry(_tools(world))
    outcomes: list[_Outcome] = []
    for index in range(runs):
        outcomes.append(await _one_run(index, seed, journal, world, registry))
        if progress is not None:
            progress(index + 1)
    return outcomes


# --- real crashes: a subprocess killed with SIGKILL mid-tool-call ----------------------------


@dataclass
class KillOutcome:
    """One real kill-and-resume: how the resumed run ended and how often the booking ran."""

    mode: str
    status: str
    bookings: int
    doubles: int
    error: str | None = None


def _kill_plan() -> list[Any]:
    return [
        _call("search_flights", {"origin": "Paris", "destination": "Rome"}),
        _call("book_flight", {"flight": "KL7", "passengers": 2}),
        _FINAL,
    ]


def _booking_tools(bookings_path: Path, marker: Path | None, hang_in_tool: bool) -> ToolRegistry:
    @tool
    def search_flights(origin: str, destination: str) -> str:
        """Find flights.

        Args:
            origin: From.
            destination: To.
        """
        return '[{"flight": "KL7"}]'

    @tool(side_effect=True, idempotent=False)
    def book_flight(flight: str, passengers: int, ctx: ToolContext | None = None) -> str:
        """Book seats on a flight.

        Args:
            flight: Flight number.
            passengers: Seats.
        """
        assert ctx is not None
        with sqlite3.connect(bookings_path) as conn:
            conn.execute(
                "INSERT INTO bookings (session, key, flight, passengers) VALUES (?, ?, ?, ?)",
                (ctx.session_id, ctx.idempotency_key, flight, passengers),
            )
        if marker is not None and hang_in_tool:
            marker.write_text("in tool")
            time.sleep(120)
        return f"booked {passengers} on {flight}"

    return ToolRegistry([search_flights, book_flight])


def _kill_loop(
    journal: ToolJournal, registry: ToolRegistry, checkpoint: Path, hooks_marker: Path | None
) -> ToolLoop:
    def before_model_call(step: int, messages: list[Message]) -> None:
        payload = {"step": step, "messages": [m.model_dump(mode="json") for m in messages]}
        temporary = checkpoint.with_suffix(".tmp")
        temporary.write_text(json.dumps(payload))
        temporary.replace(checkpoint)

    def after_step(record: StepRecord) -> None:
        if hooks_marker is not None and any(r.tool == "book_flight" for r in record.tool_results):
            hooks_marker.write_text("after result")
            time.sleep(120)

    return ToolLoop(
        _PlannedModel(_kill_plan()),
        registry,
        guards=GuardConfig(max_steps=8, run_timeout_s=300, model_timeout_s=5),
        journal=journal,
        hooks=LoopHooks(before_model_call=before_model_call, after_step=after_step),
    )


def _worker(folder: Path, session: str, mode: str) -> None:
    """The process that gets killed: runs a booking until the marker says it is mid-call."""
    marker = folder / f"{session}.marker"
    registry = _booking_tools(folder / "bookings.db", marker, hang_in_tool=mode == "in_tool")
    db = SQLiteDatabase(folder / "journal.db")
    loop = _kill_loop(
        SQLiteToolJournal(db),
        registry,
        folder / f"{session}.checkpoint.json",
        marker if mode == "after_result" else None,
    )
    asyncio.run(loop.arun([Message.user("Book KL7 for two.")], session_id=session))


def kill_and_resume(folder: Path, number: int, seed: int) -> KillOutcome:
    mode = "in_tool" if number % 2 == 0 else "after_result"
    session = f"kill-{seed}-{number}"
    bookings = folder / "bookings.db"
    with sqlite3.connect(bookings) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bookings "
            "(session TEXT, key TEXT, flight TEXT, passengers INTEGER)"
        )
    marker = folder / f"{session}.marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen(
        [sys.executable, "-m", "keel.bench.faults", "--worker", str(folder), session, mode],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                stderr = process.stderr.read().decode() if process.stderr else ""
                return KillOutcome(
                    mode, "worker_failed", 0, 0, f"worker did not reach the call: {stderr[-300:]}"
                )
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
    return resume_after_kill(folder, session, mode)


def resume_after_kill(folder: Path, session: str, mode: str) -> KillOutcome:
    """Resume a killed worker's run in this process; count the bookings it made."""
    checkpoint = json.loads((folder / f"{session}.checkpoint.json").read_text())
    messages = [Message.model_validate(m) for m in checkpoint["messages"]]
    db = SQLiteDatabase(folder / "journal.db")
    try:
        loop = _kill_loop(
            SQLiteToolJournal(db),
            _booking_tools(folder / "bookings.db", None, hang_in_tool=False),
            folder / f"{session}.resumed.json",
            None,
        )
        try:
            result = asyncio.run(
                loop.arun(messages, session_id=session, first_step=int(checkpoint["step"]))
            )
            status: str = result.status
            error: str | None = None
        except Exception as exc:
            status, error = "raised", f"{type(exc).__name__}: {exc}"
    finally:
        db.close()
    with sqlite3.connect(folder / "bookings.db") as conn:
        rows = conn.execute(
            "SELECT key, COUNT(*) FROM bookings WHERE session = ? GROUP BY key", (session,)
        ).fetchall()
    total = sum(int(count) for _, count in rows)
    doubles = sum(1 for _, count in rows if int(count) > 1)
    return KillOutcome(
        mode=mode,
        status=status,
        bookings=total,
        doubles=doubles,
        error=error,
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
