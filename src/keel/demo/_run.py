"""``keel demo``: a long flight-booking conversation, a SIGKILL mid tool call, a resume.

The parent plays the customer (`FlightUser`) and drives a worker process
that runs the agent. Midway, while the worker is inside the booking itself (``book_flight``, a
non-idempotent tool: the airline has booked, the result is neither journalled nor
checkpointed), the parent kills it with SIGKILL and starts a new worker. That worker settles
the in-doubt booking as an operator would (``keel tools in-doubt``, checked against the
airline's records by its request key) and finishes the interrupted turn from the last
checkpoint. The report counts what a customer would notice, from the airline's own records:
questions asked again after the crash, trips booked twice, trips not booked. ``journal=False``
runs the same demo without the durable journal: it must fail (the resumed turn books again).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import IO, Any

from pydantic import BaseModel, Field

from keel._urls import parse_database_url, redact_url
from keel.demo._flights import BOOKED_REPLY, Airline, FlightUser, plans, question_slot
from keel.demo._junk import (
    PROMPTED_FILE,
    MemoryAudit,
    StoredMemory,
    audit_memories,
    read_prompted,
)
from keel.errors import KeelRuntimeError

__all__ = ["DemoReport", "run_demo", "sparkline_chart"]


class DemoReport(BaseModel):
    """What the demo did, in the figures a reviewer checks."""

    turns: int = Field(description="User messages handled.")
    trips_planned: int = Field(description="Trips the simulated customer set out to book.")
    bookings: int = Field(description="Bookings the airline holds.")
    resumed_after_kill: bool = Field(description="A worker was SIGKILLed and a new one resumed.")
    repeated_questions_after_resume: int = Field(
        description="Questions for details the customer had already given, after the resume."
    )
    double_bookings: int = Field(description="Trips the airline booked more than once.")
    max_prompt_tokens: int = Field(description="Largest prompt sent to the model.")
    prompt_budget: int = Field(description="Tokens a prompt may take (working budget - reserve).")
    loops_caught: int = Field(description="Loops the guards caught.")
    failed_turns: int = Field(description="Turns that ended without an answer.")
    in_doubt_settled: int = Field(
        default=0,
        description="In-doubt bookings settled from the airline's records after the kill.",
    )
    journal: bool = Field(default=True, description="Whether the durable tool journal was on.")
    passed: bool = Field(
        default=True, description="No double booking, every trip booked, nothing asked again."
    )
    problems: list[str] = Field(default_factory=list, description="Why it did not pass.")
    seconds: float = Field(description="Wall time of the whole demo.")
    model: str = Field(description="The model that played the agent.")
    workdir: str = Field(description="Where the demo's database and logs are.")
    database: str = Field(
        default="sqlite", description="Where the agent's state, journal, traces and memory were."
    )
    junk_memories: int | None = Field(
        default=None,
        description="Stored memories that restate the system prompt, the rules, a resume prompt "
        "or a retrieved memory, invent a profile or duplicate another (None: memory off).",
    )
    memory_audit: MemoryAudit | None = Field(
        default=None, description="What memory holds after the run, junk by reason."
    )
    prompt_tokens_per_turn: list[int] = Field(
        default_factory=list, exclude=True, description="Largest prompt of each turn."
    )


class _Worker:
    """One worker process and a reader thread for its stdout."""

    def __init__(
        self,
        workdir: Path,
        model: str,
        memory: bool,
        journal: bool = True,
        database: str | None = None,
        redis_url: str | None = None,
    ) -> None:
        command = [
            sys.executable,
            "-m",
            "keel.demo._worker",
            "--workdir",
            str(workdir),
            "--model",
            model,
        ]
        if not memory:
            command.append("--no-memory")
        if not journal:
            command.append("--no-journal")
        if database:
            command += ["--database", database]
        if redis_url:
            command += ["--redis-url", redis_url]
        self.workdir = workdir
        self._stderr = (workdir / "worker.stderr").open("ab")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )
        self.lines: Queue[dict[str, Any] | None] = Queue()
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        try:
            for line in stream:
                if line.strip():
                    self.lines.put(json.loads(line))
        except (OSError, ValueError):  # the pipe closed under us: the worker is gone
            pass
        self.lines.put(None)

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self, *, stalled: Path | None, timeout_s: float) -> dict[str, Any] | None:
        """The next line; None when ``stalled`` appeared first (the worker is in the tool)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stalled is not None and stalled.exists():
                return None
            try:
                line = self.lines.get(timeout=0.05)
            except Empty:
                continue
            if line is None:
                log = self.workdir / "worker.stderr"
                raise KeelRuntimeError(
                    f"the demo worker exited unexpectedly (code {self.process.wait()})"
                    f"{_cause(log)}; its log is {log}"
                )
            return line
        raise KeelRuntimeError(f"the demo worker did not answer within {timeout_s:g} s")

    def kill(self) -> None:
        """SIGKILL: no cleanup, no flush, exactly like a crash."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._release()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._release()

    def _release(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


def _cause(log: Path) -> str:
    """': <the exception that ended the worker>', from the last line of its log ('' if none):
    a user needs the cause (an unknown model, a database it cannot open) on the terminal."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    name, colon, message = last.partition(": ")
    if not colon or not name.replace(".", "").replace("_", "").isalnum():
        return f": {last}" if last else ""
    return f": {name.rsplit('.', 1)[-1]}: {message}"


def run_demo(
    *,
    model: str = "scripted",
    trips: int = 20,
    side_questions: int = 10,
    kill: bool = True,
    memory: bool = True,
    journal: bool = True,
    workdir: Path | None = None,
    database: str | None = None,
    redis_url: str | None = None,
    turn_timeout_s: float = 300.0,
    on_turn: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> DemoReport:
    """Run the demo and return its report.

    Args:
        model: ``scripted`` (deterministic policy, the default), ``local:smollm2``, or any
            model spec (an OpenAI-compatible endpoint from the settings).
        trips: trips the customer books.
        side_questions: side questions per trip (policy look-ups with long tool output).
        kill: SIGKILL the worker inside the booking of the middle trip, then resume.
        memory: give the agent long-term memory (embedded, MiniLM embeddings).
        journal: give the agent its durable tool journal; ``False`` is the control run that
            must fail (``passed`` false, a trip booked twice).
        workdir: where the airline's records, logs and (by default) the database are.
        database: the agent's database URL (default: ``sqlite:///WORKDIR/keel.db``); each
            worker, the restarted one too, opens its agent from it with ``Agent.open``.
        redis_url: keep the agent's state on this Redis (the rest stays on ``database``).
        on_turn: called after each turn with (turn, trips booked so far, reply): the trips
            are the progress a caller can show against a known total (how many turns a trip
            takes depends on the model's replies).
    """
    started = time.monotonic()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="keel-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    conversation = _Conversation(
        functools.partial(_Worker, workdir, model, memory, journal, database, redis_url),
        FlightUser(plans(trips, side_questions)),
        workdir,
        kill_trip=trips // 2 if kill else None,
        # More turns than any trip plan needs: a model that never finishes a booking stops here.
        turn_bound=2 * trips * (side_questions + 7),
        timeout_s=turn_timeout_s,
        on_turn=on_turn,
    )
    audit = conversation.run(audit_memory=memory)
    return _report(
        conversation.tally,
        audit,
        trips=trips,
        kill=kill,
        journal=journal,
        model=model,
        workdir=workdir,
        database=database,
        redis_url=redis_url,
        started=started,
    )


@dataclass
class _Tally:
    """What the customer's side counts over the run, turn by turn."""

    turns: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    """The largest prompt of each turn."""
    budget: int = 0
    loops: int = 0
    failed: int = 0
    booked: int = 0
    resumed: bool = False
    settled: int = 0
    repeated: int = 0
    """Questions, after the resume, for a detail the customer gave earlier in the trip."""

    def add(self, reply: dict[str, Any], given: set[str]) -> None:
        """One turn's ``reply``; ``given``: the details the customer gave in this trip."""
        self.turns += 1
        text = str(reply.get("text", ""))
        if self.resumed:
            asked = question_slot(text)
            if asked is not None and asked in given:
                self.repeated += 1
        self.prompt_tokens.append(int(reply.get("max_prompt_tokens", 0)))
        self.budget = int(reply.get("prompt_limit", self.budget))
        self.loops += int(reply.get("loops_detected", 0))
        self.failed += reply.get("status") != "completed"
        self.booked += BOOKED_REPLY in text


class _Conversation:
    """The customer talking to the worker, one message a turn, until the trips are booked;
    inside the booking of trip ``kill_trip`` (None: never) the worker is SIGKILLed, and a new
    one settles the in-doubt booking and resumes the interrupted turn."""

    def __init__(
        self,
        new_worker: Callable[[], _Worker],
        customer: FlightUser,
        workdir: Path,
        *,
        kill_trip: int | None,
        turn_bound: int,
        timeout_s: float,
        on_turn: Callable[[int, int, dict[str, Any]], None] | None,
    ) -> None:
        self._new_worker = new_worker
        self._customer = customer
        self._workdir = workdir
        self._stalled = workdir / "stalled"
        self._kill_trip = kill_trip
        self._turn_bound = turn_bound
        self._timeout_s = timeout_s
        self._on_turn = on_turn
        self.tally = _Tally()

    def run(self, *, audit_memory: bool) -> MemoryAudit | None:
        """Talk until done; then, if ``audit_memory``, audit what the agent's memory holds."""
        self._start_worker()
        try:
            self._talk()
            if not audit_memory:
                return None
            return _audit_memory(self._worker, self._workdir, self._timeout_s)
        finally:
            self._worker.close()

    def _start_worker(self) -> None:
        self._worker = self._new_worker()
        self._worker.receive(stalled=None, timeout_s=self._timeout_s)  # ready

    def _talk(self) -> None:
        customer, tally = self._customer, self.tally
        reply_text = ""
        given: set[str] = set()
        trip_seen = -1
        while True:
            message = customer.next_message(reply_text)
            if message is None or tally.turns >= self._turn_bound:
                return
            if customer.trip_index != trip_seen:
                trip_seen, given = customer.trip_index, set()
            answered = question_slot_answer(message)
            if answered is not None:
                given.add(answered)
            killing = self._kill_trip is not None and not tally.resumed
            if killing and customer.trip_index == self._kill_trip and message == "Yes, book it.":
                (self._workdir / "stall").write_text("stall inside the next book_flight")
            self._worker.send({"op": "say", "text": message})
            reply = self._worker.receive(
                stalled=self._stalled if killing else None, timeout_s=self._timeout_s
            )
            if reply is None:
                reply = self._kill_and_resume()
            assert reply is not None
            reply_text = str(reply.get("text", ""))
            tally.add(reply, given)
            if self._on_turn is not None:
                self._on_turn(tally.turns, tally.booked, reply)

    def _kill_and_resume(self) -> dict[str, Any] | None:
        """The worker is inside the booking: kill it, start another, settle, resume."""
        self._worker.kill()
        self._stalled.unlink()
        self._start_worker()
        self._worker.send({"op": "settle"})
        answer = self._worker.receive(stalled=None, timeout_s=self._timeout_s)
        self.tally.settled = len(answer.get("keys", [])) if answer is not None else 0
        self._worker.send({"op": "resume"})
        reply = self._worker.receive(stalled=None, timeout_s=self._timeout_s)
        self.tally.resumed = bool(reply is not None and reply.get("resumed"))
        return reply


def _report(
    tally: _Tally,
    audit: MemoryAudit | None,
    *,
    trips: int,
    kill: bool,
    journal: bool,
    model: str,
    workdir: Path,
    database: str | None,
    redis_url: str | None,
    started: float,
) -> DemoReport:
    """The customer's ``tally`` and the memory ``audit`` against the airline's own records,
    with why the run did not pass (no problems: it did); ``started``: the demo's start on
    the monotonic clock."""
    per_trip = Airline(workdir / "airline.db").bookings_per_trip()
    doubles = sum(1 for count in per_trip.values() if count > 1)
    problems = []
    if doubles:
        problems.append(f"{doubles} trip(s) booked more than once")
    if len(per_trip) != trips:
        problems.append(f"{len(per_trip)} of {trips} trips booked")
    if tally.repeated:
        problems.append(f"{tally.repeated} question(s) asked again after the resume")
    if kill and not tally.resumed:
        problems.append("the killed turn was not resumed")
    if audit is not None and audit.junk:
        problems.append(f"{audit.junk} junk memor{'y' if audit.junk == 1 else 'ies'} stored")
    return DemoReport(
        turns=tally.turns,
        trips_planned=trips,
        bookings=sum(per_trip.values()),
        resumed_after_kill=tally.resumed,
        repeated_questions_after_resume=tally.repeated,
        double_bookings=doubles,
        in_doubt_settled=tally.settled,
        journal=journal,
        passed=not problems,
        problems=problems,
        max_prompt_tokens=max(tally.prompt_tokens, default=0),
        prompt_budget=tally.budget,
        loops_caught=tally.loops,
        failed_turns=tally.failed,
        seconds=round(time.monotonic() - started, 2),
        model=model,
        workdir=str(workdir),
        database=_where(workdir, database, redis_url),
        junk_memories=None if audit is None else audit.junk,
        memory_audit=audit,
        prompt_tokens_per_turn=tally.prompt_tokens,
    )


def _audit_memory(worker: _Worker, workdir: Path, timeout_s: float) -> MemoryAudit:
    """Every stored memory against what the prompts held (see `keel.demo._junk`)."""
    worker.send({"op": "memories"})
    answer = worker.receive(stalled=None, timeout_s=timeout_s)
    assert answer is not None
    records = [StoredMemory.model_validate(r) for r in answer["records"]]
    if len(records) != int(answer["total"]):
        raise KeelRuntimeError(
            f"the memory audit read {len(records)} of {answer['total']} stored records"
        )
    return audit_memories(records, read_prompted(workdir / PROMPTED_FILE))


def _where(workdir: Path, database: str | None, redis_url: str | None) -> str:
    url = database or f"sqlite:///{workdir / 'keel.db'}"
    kind = parse_database_url(url).kind
    where = f"{kind} ({redact_url(url)})"
    return f"{where}, state on redis ({redact_url(redis_url)})" if redis_url else where


def question_slot_answer(message: str) -> str | None:
    """Which detail a customer message gives (the inverse of the questions)."""
    if message.startswith("From "):
        return "origin"
    if message.startswith("To "):
        return "destination"
    if message.startswith(("Travelling ", "Actually, change the dates")):
        return "dates"
    if message.endswith(" passengers."):
        return "passengers"
    return None


_BLOCKS = " ▁▂▃▄▅▆▇█"


def sparkline_chart(values: list[int], *, limit: int, width: int = 64, height: int = 6) -> str:
    """A small terminal chart of ``values`` (max per column) against ``limit``."""
    if not values:
        return "(no turns)"
    columns = min(width, len(values))
    bucket = len(values) / columns
    peaks = [
        max(values[int(i * bucket) : max(int((i + 1) * bucket), int(i * bucket) + 1)])
        for i in range(columns)
    ]
    top = max(limit, max(peaks), 1)
    rows = []
    for row in range(height, 0, -1):
        line = ""
        for peak in peaks:
            level = peak / top * height
            filled = level - (row - 1)
            line += _BLOCKS[8] if filled >= 1 else _BLOCKS[max(0, int(filled * 8))]
        label = f"{int(top * row / height):>7,} |" if row in (height, 1) else "        |"
        rows.append(label + line)
    rows.append("        +" + "-" * columns)
    rows.append(f"         turn 1 .. {len(values)}   (budget {limit:,} tokens)")
    return "\n".join(rows)
