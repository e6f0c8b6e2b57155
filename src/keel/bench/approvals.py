"""``keel bench approvals``: approval flows through two worker processes, with SIGKILLs.

Each flow is one turn of the real [`Agent`][] in which a scripted model asks
for a refund that an operator must approve (``@tool(approval=...)``): the turn parks, and
then the flow's decision comes, from the *other* worker process (the one that parked it is not
the one that resumes it, as with stateless service workers on one database): an approval, a
rejection, a correction (approved with other arguments), no decision until it expires, the
same decision sent twice, or two operators deciding at once from both workers (one approves,
one rejects). Some flows get a SIGKILL at a random point: the deciding worker killed a random
few milliseconds after it was sent the decision (before the decision commits, after it, in
the resumed turn), or inside the approved tool, before or after its effect; the decision is
then sent again to the live worker, as a client retries a request whose worker died.

What is counted comes from the effects themselves, the refund tool's own effect log (a SQLite
file apart from keel's, keyed by the refund's idempotency key as a payment provider keys
them) and the committed sessions, checked against the decision that stands in the queue:

* ``approved_not_run``: approved requests whose refund has no effect.
* ``rejected_run``: rejected or expired requests whose refund has an effect.
* ``doubled``: refunds with more than one effect (run under two different keys).
* ``wrong_arguments``: refunds that took effect with other arguments than decided.
* ``lost_turns``: flows whose session does not end with the model's answer to the refund,
  or still waits.

The time from a decision to the call's effect is measured in the deciding worker (from the
call to ``agent.decide`` to the effect's timestamp; a restarted worker's first decision, which
also loads the code a decision runs, is left out), next to a plain tool call's (from the call
to ``agent.run`` to the effect of a tool that needs no approval).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from keel.approvals import ApprovalRequest
from keel.errors import ApprovalSettledError, KeelError
from keel.messages import Message
from keel.runtime import Agent, session_key
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import ApprovalNeed, Tool, ToolContext, tool

__all__ = ["ApprovalBenchReport", "EffectLog", "run_approval_bench"]

KINDS = ("approve", "reject", "correct", "expire", "duplicate", "concurrent")
_WEIGHTS = (35, 20, 15, 10, 10, 10)
_KILL_POINTS = ("random", "tool_before_effect", "tool_after_effect")
_TENANT = "bench"
_USER = "bench-user"
_EXPIRES_S = 0.1
"""How long an expiring flow's request may wait (the other flows' never expire)."""
_LEASE_TTL_S = 1.0
"""A killed worker's session lease lapses after this: the retry waits at most that long."""
_KILL_WITHIN_S = 0.03
"""A random kill lands within this long after the decision was sent."""


# --- the effect log: the payment provider's own records -------------------------------------


class EffectLog:
    """Every run of the refund tool's body (``attempts``) and every refund that took effect
    (``effects``, one per idempotency key, as a payment provider deduplicates a retried
    request), in a SQLite file apart from keel's, written from any process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with contextlib.closing(self._connect()) as conn:
            conn.executescript(
                "CREATE TABLE IF NOT EXISTS attempts (order_key TEXT, idempotency_key TEXT, "
                "amount INTEGER, pid INTEGER, at REAL);"
                "CREATE TABLE IF NOT EXISTS effects (idempotency_key TEXT PRIMARY KEY, "
                "order_key TEXT, amount INTEGER, at REAL);"
            )

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        return conn

    def record(self, order: str, idempotency_key: str, amount: int) -> None:
        now = time.time()
        with contextlib.closing(self._connect()) as conn:
            conn.execute(
                "INSERT INTO attempts VALUES (?, ?, ?, ?, ?)",
                (order, idempotency_key, amount, os.getpid(), now),
            )
            conn.execute(
                "INSERT INTO effects VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (idempotency_key, order, amount, now),
            )

    def effects(self) -> dict[str, list[tuple[int, float]]]:
        """Each order's effects: (amount, when)."""
        found: dict[str, list[tuple[int, float]]] = {}
        with contextlib.closing(self._connect()) as conn:
            rows = conn.execute("SELECT order_key, amount, at FROM effects ORDER BY at").fetchall()
        for order, amount, at in rows:
            found.setdefault(str(order), []).append((int(amount), float(at)))
        return found

    def repeated_attempts(self) -> int:
        """Runs of the tool's body beyond the first under the same key (after a kill)."""
        with contextlib.closing(self._connect()) as conn:
            row = conn.execute(
                "SELECT COUNT(*) - COUNT(DISTINCT idempotency_key) FROM attempts"
            ).fetchone()
        return int(row[0])


# --- a worker: the agent, its tools and its scripted model -----------------------------------


def _kill_armed(folder: Path, order: str, where: str) -> None:
    """SIGKILL this process here if the coordinator armed ``where`` for ``order`` (once)."""
    plan = folder / f"kill-{order}"
    with contextlib.suppress(FileNotFoundError):
        if plan.read_text() == where:
            plan.unlink()
            os.kill(os.getpid(), signal.SIGKILL)


def _refund_policy(arguments: Any, context: ToolContext) -> ApprovalNeed:
    expiring = str(arguments.order).endswith("-x")
    return ApprovalNeed(
        "operator",
        "refunds need an operator",
        expires_after_s=_EXPIRES_S if expiring else None,
    )


def bench_tools(folder: Path, log: EffectLog) -> list[Tool]:
    """``refund`` (an operator approves each call) and ``lookup`` (a plain call)."""

    @tool(side_effect=True, idempotent=True, approval=_refund_policy)
    def refund(order: str, amount: int, ctx: ToolContext | None = None) -> str:
        """Refund an order (the payment provider deduplicates by idempotency key).

        Args:
            order: The order.
            amount: How much.
        """
        assert ctx is not None
        _kill_armed(folder, order, "tool_before_effect")
        log.record(order, ctx.idempotency_key, amount)
        _kill_armed(folder, order, "tool_after_effect")
        return f"refunded {amount} for {order}"

    @tool(side_effect=True, idempotent=True)
    def lookup(order: str, ctx: ToolContext | None = None) -> str:
        """Look an order up.

        Args:
            order: The order.
        """
        assert ctx is not None
        log.record(order, ctx.idempotency_key, 0)
        return f"{order}: shipped"

    return [refund, lookup]


def _flow_text(call: ScriptedCall) -> tuple[int, str]:
    """The index of the newest refund or lookup request in the messages, and its text."""
    for index in range(len(call.messages) - 1, -1, -1):
        message = call.messages[index]
        if message.role == "user" and message.content.startswith(("refund ", "lookup ")):
            return index, message.content
    return -1, ""


def bench_model(call: ScriptedCall) -> Message | str:
    """Calls the tool the newest request names; once anything followed it, answers."""
    index, text = _flow_text(call)
    if index < 0:
        return "Nothing to do."
    words = text.split()
    if index < len(call.messages) - 1:
        return f"done {words[1]}"
    if words[0] == "lookup":
        return ScriptedModel.tool_call("lookup", json.dumps({"order": words[1]}))
    arguments = {"order": words[1], "amount": int(words[2])}
    return ScriptedModel.tool_call("refund", json.dumps(arguments))


async def _worker_command(agent: Agent, command: dict[str, Any]) -> dict[str, Any]:
    op, session = command["op"], command["session"]
    started = time.time()
    if op == "turn":
        reply = await agent.run(command["text"], session=session, user=_USER)
    elif op == "decide":
        try:
            reply = await agent.decide(
                session,
                command["id"],
                approve=command["approve"],
                by=command["by"],
                note=command.get("note"),
                arguments=command.get("arguments"),
            )
        except ApprovalSettledError as exc:
            # The loser of a concurrent decision, or a late one: refused, nothing ran.
            return {"status": exc.request.status, "settled_otherwise": True, "t0": started}
    else:
        resumed = await agent.resume(session, _USER)
        if resumed is None:
            return {"status": None, "t0": started}
        reply = resumed
    ids = [approval.id for approval in reply.approvals]
    return {"status": reply.status, "approvals": ids, "t0": started, "text": reply.text}


async def _serve(folder: Path) -> None:
    """A worker: one agent on the shared database, one command per stdin line, one JSON
    answer per stdout line."""
    settings = load_settings(database=f"sqlite:///{folder / 'keel.db'}")
    backends = Backends.open(settings, memory=False)
    agent = Agent.on_backends(
        backends,
        ScriptedModel(bench_model),
        system_prompt="You refund orders.",
        tools=bench_tools(folder, EffectLog(folder / "effects.db")),
        tenant_id=_TENANT,
        lease_ttl_s=_LEASE_TTL_S,
        session_wait_s=10.0,
    )
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            answer = await _worker_command(agent, json.loads(line))
        except KeelError as exc:
            answer = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(answer), flush=True)
    await backends.aclose()


# --- the coordinator -------------------------------------------------------------------------


class _Worker:
    """A worker process, spoken to over its stdin and stdout."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.process = self._start()
        self.decided = 0
        """Decisions this process made: its first one also loads the code a decision runs."""

    def _start(self) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "keel.bench.approvals", "--worker", str(self.folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_python_env(),
        )
        assert process.stdout is not None
        ready = process.stdout.readline()
        if not ready:
            raise RuntimeError("a bench worker did not start")
        return process

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any] | None:
        """The answer, or None when the worker died first."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, command: dict[str, Any]) -> dict[str, Any] | None:
        self.send(command)
        return self.receive()

    def kill_and_restart(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._close_pipes()
        self.process = self._start()
        self.decided = 0

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def stop(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._close_pipes()


def _python_env() -> dict[str, str]:
    source = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


@dataclass
class _Flow:
    index: int
    kind: str
    session: str
    order: str
    amount: int
    kill: str | None = None
    corrected: int | None = None
    approval_id: str | None = None
    decided_at: float | None = None
    """When the deciding worker called ``agent.decide`` (for an undisturbed approval)."""
    problems: list[str] = field(default_factory=list)


class ApprovalBenchReport(BaseModel):
    """What ``keel bench approvals`` measured."""

    flows: int
    seed: int
    sessions: int
    by_kind: dict[str, int]
    kills: int = Field(description="Worker processes SIGKILLed (random points and in-tool).")
    kills_by_point: dict[str, int]
    approved_not_run: int
    rejected_run: int
    doubled: int
    wrong_arguments: int
    lost_turns: int
    repeated_attempts: int = Field(
        description="Runs of the refund tool's body repeated under the same idempotency key "
        "(after a kill inside the tool; the provider deduplicated them)."
    )
    decision_to_effect_ms_p50: float
    decision_to_effect_ms_p95: float
    plain_call_ms_p50: float
    plain_call_ms_p95: float
    plain_calls: int
    failures: list[str] = Field(description="The first few flows that went wrong, and how.")
    seconds: float


def _percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))], 2)


def _plan(flows: int, seed: int, sessions: int, kills: int) -> list[_Flow]:
    rng = random.Random(seed)
    planned = []
    for index in range(flows):
        kind = rng.choices(KINDS, _WEIGHTS)[0]
        order = f"o{index}" + ("-x" if kind == "expire" else "")
        flow = _Flow(index, kind, f"s{index % sessions}", order, rng.randint(100, 999))
        if kind == "correct":
            flow.corrected = rng.randint(1, 99)
        planned.append(flow)
    killable = [flow for flow in planned if flow.kind in ("approve", "correct", "duplicate")]
    for flow in rng.sample(killable, min(kills, len(killable))):
        flow.kill = rng.choice(_KILL_POINTS)
    return planned


class _Bench:
    """Two workers on one database, the flows sent to them, and the sessions read back."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.folder = folder
        self.rng = random.Random(seed + 1)
        self.kills: Counter[str] = Counter()
        self.backends = Backends.open(
            load_settings(database=f"sqlite:///{folder / 'keel.db'}"), memory=False
        )
        self.runner = asyncio.Runner()
        self.workers = [_Worker(folder), _Worker(folder)]
        self.plain_started: dict[str, float] = {}

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.runner.run(self.backends.aclose())
        self.runner.close()

    def run_flow(self, flow: _Flow) -> None:
        parker, decider = self.workers[flow.index % 2], self.workers[(flow.index + 1) % 2]
        text = f"refund {flow.order} {flow.amount}"
        parked = parker.ask({"op": "turn", "session": flow.session, "text": text})
        if parked is None or parked.get("status") != "awaiting_approval":
            flow.problems.append(f"the turn did not park: {parked}")
            return
        flow.approval_id = parked["approvals"][0]
        decision = self._decision(flow)
        if flow.kind == "expire":
            time.sleep(_EXPIRES_S * 1.5)
            self._answered(flow, decider.ask(decision), "the late approval")
        elif flow.kind == "concurrent":
            contrary = {**decision, "approve": False, "by": "operator:ivan", "note": "no"}
            decider.send(decision)
            parker.send(contrary)
            self._answered(flow, decider.receive(), "the approval")
            self._answered(flow, parker.receive(), "the contrary rejection")
        elif flow.kill is not None:
            self._killed_decision(flow, decider, parker, decision)
        else:
            answer = decider.ask(decision)
            warm = decider.decided > 0
            decider.decided += 1
            if self._answered(flow, answer, "the decision") and decision["approve"] and warm:
                # Timed on a process that decided before: a restarted worker's first decision
                # loads what a decision runs, which is start-up, not the decision.
                assert answer is not None
                flow.decided_at = answer["t0"]
            if flow.kind == "duplicate":
                self._answered(flow, parker.ask(decision), "the same decision again")
        finished = parker.ask({"op": "resume", "session": flow.session})
        self._answered(flow, finished, "the resume")
        self._check_session(flow)

    def _decision(self, flow: _Flow) -> dict[str, Any]:
        decision: dict[str, Any] = {
            "op": "decide",
            "session": flow.session,
            "id": flow.approval_id,
            "approve": flow.kind != "reject",
            "by": "operator:olga",
        }
        if flow.kind == "reject":
            decision["note"] = "not without a receipt"
        if flow.corrected is not None:
            decision["arguments"] = json.dumps({"order": flow.order, "amount": flow.corrected})
        return decision

    def _answered(self, flow: _Flow, answer: dict[str, Any] | None, what: str) -> bool:
        if answer is None or "error" in answer:
            flow.problems.append(f"{what} failed: {answer}")
            return False
        return True

    def _killed_decision(
        self, flow: _Flow, decider: _Worker, survivor: _Worker, decision: dict[str, Any]
    ) -> None:
        """The decision sent, the deciding worker SIGKILLed (at a random moment, or inside
        the tool where armed), then the same decision sent to the live worker (a retry)."""
        assert flow.kill is not None
        self.kills[flow.kill] += 1
        if flow.kill == "random":
            decider.send(decision)
            time.sleep(self.rng.uniform(0, _KILL_WITHIN_S))
        else:
            (self.folder / f"kill-{flow.order}").write_text(flow.kill)
            if decider.ask(decision) is not None:
                flow.problems.append(f"the kill armed at {flow.kill} did not fire")
        decider.kill_and_restart()
        self._answered(flow, survivor.ask(decision), "the retried decision")

    def _check_session(self, flow: _Flow) -> None:
        """The session's committed state ends with the model's answer to this flow, and
        waits for nothing."""
        key = session_key(_TENANT, flow.session)
        checkpoint = self.runner.run(self.backends.state.aget(key))
        if checkpoint is None:
            flow.problems.append("lost turn: no committed state")
            return
        runtime = checkpoint.state.runtime
        last = checkpoint.state.messages[-1] if checkpoint.state.messages else None
        answered = last is not None and last.content == f"done {flow.order}"
        if not answered or runtime.awaiting or runtime.open_turn is not None:
            flow.problems.append(
                f"lost turn: last message {last and last.content!r}, awaiting "
                f"{runtime.awaiting}, open turn {runtime.open_turn}"
            )

    def plain_call(self, index: int, turn: int) -> None:
        # Each session's turns alternate between the workers, as a decision comes from the
        # worker that did not park the turn: neither finds the session in its own cache.
        worker = self.workers[turn % 2]
        order = f"l{index}"
        answer = worker.ask(
            {"op": "turn", "session": f"plain{index % 4}", "text": f"lookup {order}"}
        )
        if answer is not None and answer.get("status") == "completed":
            self.plain_started[order] = answer["t0"]

    def request(self, approval_id: str) -> ApprovalRequest | None:
        return self.runner.run(self.backends.approvals.aget(_TENANT, approval_id))


def run_approval_bench(
    flows: int = 1000,
    *,
    seed: int = 0,
    sessions: int = 8,
    kills: int = 30,
    plain_every: int = 5,
    workdir: Path | None = None,
) -> ApprovalBenchReport:
    """Run ``flows`` approval flows over ``sessions`` sessions and two worker processes,
    ``kills`` of them with a SIGKILL, and a plain tool call every ``plain_every`` flows."""
    started = time.perf_counter()
    planned = _plan(flows, seed, sessions, kills)
    with _folder(workdir) as folder:
        log = EffectLog(folder / "effects.db")
        bench = _Bench(folder, seed)
        try:
            for flow in planned:
                bench.run_flow(flow)
                if plain_every and flow.index % plain_every == 0:
                    bench.plain_call(flow.index, flow.index // (plain_every * 4))
            standing = {
                flow.index: bench.request(flow.approval_id) if flow.approval_id else None
                for flow in planned
            }
        finally:
            bench.close()
        return _report(planned, standing, log, bench, seed, sessions, started)


@contextlib.contextmanager
def _folder(workdir: Path | None) -> Iterator[Path]:
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    with tempfile.TemporaryDirectory(prefix="keel-bench-approvals-") as folder:
        yield Path(folder)


def _tally(
    flow: _Flow, request: ApprovalRequest | None, effects: list[tuple[int, float]]
) -> Counter[str]:
    """What went wrong with one flow, by figure (also noted in its problems)."""
    wrong: Counter[str] = Counter()
    status = None if request is None else request.status
    if status == "approved" and not effects:
        wrong["approved_not_run"] += 1
    if status in ("rejected", "expired", "cancelled") and effects:
        wrong["rejected_run"] += 1
    if len(effects) > 1:
        wrong["doubled"] += 1
    if status == "approved" and effects:
        decision = request.decision if request is not None else None
        corrected = decision.arguments if decision is not None else None
        amount = json.loads(corrected)["amount"] if corrected else flow.amount
        if any(effect_amount != amount for effect_amount, _ in effects):
            wrong["wrong_arguments"] += 1
    if flow.kind == "expire" and status != "expired":
        flow.problems.append(f"an expiring request ended {status}")
    if any(problem.startswith("lost turn") for problem in flow.problems):
        wrong["lost_turns"] += 1
    for figure in wrong:
        flow.problems.append(f"{figure}: {status}, effects {effects}")
    return wrong


def _report(
    planned: list[_Flow],
    standing: dict[int, ApprovalRequest | None],
    log: EffectLog,
    bench: _Bench,
    seed: int,
    sessions: int,
    started: float,
) -> ApprovalBenchReport:
    effects = log.effects()
    wrong: Counter[str] = Counter()
    to_effect: list[float] = []
    for flow in planned:
        found = effects.get(flow.order, [])
        wrong += _tally(flow, standing[flow.index], found)
        if flow.decided_at is not None and found:
            to_effect.append((found[0][1] - flow.decided_at) * 1000)
    plain = [
        (effects[order][0][1] - at) * 1000
        for order, at in bench.plain_started.items()
        if order in effects
    ]
    return ApprovalBenchReport(
        flows=len(planned),
        seed=seed,
        sessions=sessions,
        by_kind=dict(Counter(flow.kind for flow in planned)),
        kills=sum(bench.kills.values()),
        kills_by_point=dict(bench.kills),
        approved_not_run=wrong["approved_not_run"],
        rejected_run=wrong["rejected_run"],
        doubled=wrong["doubled"],
        wrong_arguments=wrong["wrong_arguments"],
        lost_turns=wrong["lost_turns"],
        repeated_attempts=log.repeated_attempts(),
        decision_to_effect_ms_p50=_percentile(to_effect, 0.5),
        decision_to_effect_ms_p95=_percentile(to_effect, 0.95),
        plain_call_ms_p50=_percentile(plain, 0.5),
        plain_call_ms_p95=_percentile(plain, 0.95),
        plain_calls=len(plain),
        failures=[f"flow {f.index} ({f.kind}): {f.problems}" for f in planned if f.problems][:10],
        seconds=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        asyncio.run(_serve(Path(sys.argv[2])))
    else:
        print("usage: python -m keel.bench.approvals --worker FOLDER", file=sys.stderr)
        sys.exit(2)
