"""The Agent's invariants where users stand: through ``handle``, with scripted models, the
real SQLite stores, and effects counted from what the tools did."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

from keel.context import ContextBudget
from keel.errors import (
    AccessDeniedError,
    ConflictError,
    SessionBusyError,
    StoreError,
    UsageError,
)
from keel.guards import GuardConfig
from keel.messages import Message, Usage
from keel.models import Completion
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, tool
from tests.runtime.conftest import sqlite_agent


def _booking() -> tuple[Tool, list[str]]:
    effects: list[str] = []

    @tool(side_effect=True, idempotent=False)
    def book(ref: str) -> str:
        """Book a seat.

        Args:
            ref: The booking reference.
        """
        effects.append(ref)
        return f"BOOKED {ref}"

    return book, effects


def _books_then_answers(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}"
    text = call.last_user_text
    if text.startswith("book "):
        return ScriptedModel.tool_call("book", json.dumps({"ref": text.split()[1]}))
    return "Noted."


# --- 1. a conflicted turn changed nothing; a stale writer is rejected -----------------------


async def test_a_turn_that_cannot_own_the_session_changes_nothing(
    database: SQLiteDatabase,
) -> None:
    book, effects = _booking()
    agent = sqlite_agent(
        database, ScriptedModel(_books_then_answers), tools=[book], session_wait_s=0.2
    )
    await agent.handle("s1", "u1", "hello")
    key = agent.session_key("s1")
    before = agent.state.load(key)
    with agent.state.lock(key, ttl=30), pytest.raises(SessionBusyError):
        await agent.handle("s1", "u1", "book X1")
    after = agent.state.load(key)
    assert after.version == before.version and after.state == before.state
    assert effects == []
    assert SQLToolJournal(database).entries() == []


async def test_a_write_from_another_writer_mid_turn_is_never_overwritten(
    database: SQLiteDatabase,
) -> None:
    """A blind write (a fresh read instead of the version the turn holds) would clobber the
    other writer's version; compare-and-set rejects the stale turn instead."""
    agent: Agent

    def meddling(call: ScriptedCall) -> Message | str:
        if call.last_user_text == "second":
            key = agent.session_key("s1")
            head = agent.state.load(key)
            agent.state.checkpoint(
                key,
                head.state.model_copy(update={"data": {"written_by": "other"}}),
                expected_version=head.version,
                reason="another writer",
            )
        return "ok"

    agent = sqlite_agent(database, ScriptedModel(meddling))
    await agent.handle("s1", "u1", "first")
    with pytest.raises(ConflictError):
        await agent.handle("s1", "u1", "second")
    head = agent.state.load(agent.session_key("s1"))
    assert head.state.data == {"written_by": "other"}
    assert head.info.reason == "another writer"


# --- 3. a limit stop never hides an effect that happened ------------------------------------


async def test_a_step_limit_after_a_booking_keeps_the_booking_in_history(
    database: SQLiteDatabase,
) -> None:
    book, effects = _booking()

    def books_then_dawdles(call: ScriptedCall) -> Message | str:
        if not any(m.role == "tool" for m in call.messages):
            return ScriptedModel.tool_call("book", json.dumps({"ref": "PNR1"}))
        return ScriptedModel.tool_call("lookup", json.dumps({"q": str(len(call.messages))}))

    @tool
    def lookup(q: str) -> str:
        """Look something up.

        Args:
            q: The query.
        """
        return f"nothing for {q}"

    agent = sqlite_agent(
        database,
        ScriptedModel(books_then_dawdles),
        tools=[book, lookup],
        guards=GuardConfig(max_steps=4),
    )
    reply = await agent.handle("s1", "u1", "book PNR1 please")
    assert reply.status == "step_limit" and reply.reverted
    assert effects == ["PNR1"]
    assert reply.effects == ("book",)
    assert "BOOKED PNR1" in reply.text
    state = agent.session_state("s1")
    assert state is not None
    results = [m.content for m in state.messages if m.role == "tool"]
    assert results == ["BOOKED PNR1"], "the booking stays; the lookups are reverted"
    # The next turn's model sees the booking and so does not book again.
    seen: list[str] = []

    def looks(call: ScriptedCall) -> str:
        seen.extend(m.content for m in call.messages if m.role == "tool")
        return "You are booked."

    agent.model = ScriptedModel(looks)
    await agent.handle("s1", "u1", "did it work?")
    assert "BOOKED PNR1" in seen


# --- 4. a new message after a crash finishes the open turn first ----------------------------


async def test_a_new_message_after_a_crash_resumes_the_open_turn_first(
    database: SQLiteDatabase,
) -> None:
    book, effects = _booking()

    class _Crash(BaseException):
        pass

    crash = {"armed": True}

    def crashes_after_the_booking(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool" and crash["armed"]:
            crash["armed"] = False
            raise _Crash
        return _books_then_answers(call)

    agent = sqlite_agent(database, ScriptedModel(crashes_after_the_booking), tools=[book])
    with pytest.raises(_Crash):
        await agent.handle("s1", "u1", "book CARD7")
    # A new process: its own Agent on the same database.
    fresh = sqlite_agent(database, ScriptedModel(_books_then_answers), tools=[book])
    reply = await fresh.handle("s1", "u1", "what is the weather?")
    assert effects == ["CARD7"], "the interrupted booking was replayed, not repeated"
    assert reply.interrupted_turn is not None
    assert reply.interrupted_turn.status == "completed"
    assert "BOOKED CARD7" in reply.interrupted_turn.text
    assert reply.text == "Noted."
    state = fresh.session_state("s1")
    assert state is not None
    users = [m.content for m in state.messages if m.role == "user"]
    assert users == ["book CARD7", "what is the weather?"]
    assert state.runtime.open_turn is None


async def test_the_same_message_resent_after_a_crash_is_handled_once(
    database: SQLiteDatabase,
) -> None:
    book, effects = _booking()

    class _Crash(BaseException):
        pass

    def crashes(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            raise _Crash
        return _books_then_answers(call)

    with pytest.raises(_Crash):
        await sqlite_agent(database, ScriptedModel(crashes), tools=[book]).handle(
            "s1", "u1", "book R9"
        )
    fresh = sqlite_agent(database, ScriptedModel(_books_then_answers), tools=[book])
    reply = await fresh.handle("s1", "u1", "book R9")
    assert reply.resumed and reply.status == "completed"
    assert effects == ["R9"]
    state = fresh.session_state("s1")
    assert state is not None
    assert [m.content for m in state.messages if m.role == "user"] == ["book R9"]


@pytest.mark.postgres
async def test_on_postgres_a_booking_cut_off_by_a_crash_is_never_run_again(
    postgres_url: str,
) -> None:
    """The process dies inside the booking, after its effect and before any result or
    checkpoint: on PostgreSQL, where the journal's claims are written on the event loop's own
    connections, the next process finds the claim and does not book again."""
    effects: list[str] = []

    class _Crash(BaseException):
        pass

    @tool(side_effect=True, idempotent=False)
    def book(ref: str) -> str:
        """Book a seat.

        Args:
            ref: The booking reference.
        """
        effects.append(ref)
        if len(effects) == 1:
            raise _Crash  # the process dies with the seat booked
        return f"BOOKED {ref}"

    def on_postgres() -> Agent:
        return Agent.open(
            postgres_url,
            model=ScriptedModel(_books_then_answers),
            system_prompt="You help.",
            tools=[book],
            memory=False,
        )

    crashed = on_postgres()
    try:
        with pytest.raises(_Crash):
            await crashed.handle("s1", "u1", "book R9")
    finally:
        await crashed.aclose()
    fresh = on_postgres()
    try:
        reply = await fresh.handle("s1", "u1", "book R9")
    finally:
        await fresh.aclose()
    assert effects == ["R9"], "the booking ran again after the crash"
    assert reply.resumed and reply.status == "tool_in_doubt", reply


# --- 6. sessions belong to one tenant and one user ------------------------------------------


async def test_sessions_are_scoped_to_their_tenant_and_user(database: SQLiteDatabase) -> None:
    prompts: list[str] = []

    def records(call: ScriptedCall) -> str:
        prompts.extend(m.content for m in call.messages)
        return "ok"

    acme = sqlite_agent(database, ScriptedModel(records), tenant_id="acme")
    await acme.handle("s1", "alice", "My locker code is 7731")
    prompts.clear()
    evil = sqlite_agent(database, ScriptedModel(records), tenant_id="evil")
    await evil.handle("s1", "mallory", "what did I say?")
    assert not any("7731" in text for text in prompts), "another tenant's session leaked"
    with pytest.raises(AccessDeniedError):
        await acme.handle("s1", "mallory", "what is my locker code?")
    with pytest.raises(AccessDeniedError):
        await acme.resume("s1", "mallory")
    assert not any("7731" in text for text in prompts)
    state = acme.session_state("s1")
    assert state is not None and state.runtime.user_id == "alice"
    assert [m.content for m in state.messages if m.role == "user"] == ["My locker code is 7731"]


# --- 9. runtime corrections are never the user's words --------------------------------------


async def test_a_correction_prompt_is_not_kept_as_the_users_words(
    database: SQLiteDatabase,
) -> None:
    calls = {"n": 0}

    def cut_then_fine(call: ScriptedCall) -> Completion | str:
        calls["n"] += 1
        if calls["n"] == 1:
            return Completion(
                message=Message.assistant('{"name": "remember", "arguments": {"slot"'),
                finish_reason="length",
                usage=Usage(prompt_tokens=10, completion_tokens=5),
                model="scripted",
            )
        return "Rex is a fine name."

    from keel.memory import HashingEmbedder, Memory, Scope
    from keel.stores import SQLiteMemoryStore

    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=64))
    agent = sqlite_agent(database, ScriptedModel(cut_then_fine), memory=memory)
    reply = await agent.handle("s1", "u1", "My dog is called Rex")
    assert reply.status == "completed"
    memory.flush()
    remembered = [r.text for r in memory.recent(Scope(tenant_id="default", user_id="u1"))]
    memory.close()
    assert any("User: My dog is called Rex" in text for text in remembered), remembered
    assert not any("cut off" in text for text in remembered)
    state = agent.session_state("s1")
    assert state is not None
    users = [m for m in state.messages if m.role == "user"]
    assert [m.content for m in users] == ["My dog is called Rex"]
    assert all("keel_correction" not in m.metadata for m in state.messages)


# --- 10. several threads on one session ---------------------------------------------------


def test_handle_sync_from_two_threads_on_one_session_finishes(
    database: SQLiteDatabase,
) -> None:
    agent = sqlite_agent(database, ScriptedModel(lambda call: "ok"))
    errors: list[BaseException] = []

    def talk(name: str) -> None:
        try:
            for n in range(5):
                agent.handle_sync("s1", "u1", f"{name} {n}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "handle_sync hung"
    assert errors == []
    state = agent.session_state("s1")
    assert state is not None
    assert len([m for m in state.messages if m.role == "user"]) == 10


# --- 11, 13, 15. bad input and broken models get typed errors, never an open turn ---------


@pytest.mark.parametrize(
    ("session", "user", "text"),
    [
        ("s1", "u1", None),
        ("s1", "u1", b"bytes"),
        (42, "u1", "hi"),
        ("s1", None, "hi"),
        ("", "u1", "hi"),
        ("s1", "u1", "\u200b\u200b"),
        ("s1", "u1", " \ufeff\n"),
    ],
)
async def test_bad_arguments_are_usage_errors(
    database: SQLiteDatabase, session: object, user: object, text: object
) -> None:
    agent = sqlite_agent(database, ScriptedModel(lambda call: "ok"))
    with pytest.raises(UsageError):
        await agent.handle(session, user, text)  # type: ignore[arg-type]
    assert agent.state.sessions() == []


@pytest.mark.parametrize("text", ["日本語", "\u200bé", " \u00a0Ωμέγα\n", "🙂"])
async def test_a_message_visible_only_outside_ascii_is_answered(
    database: SQLiteDatabase, text: str
) -> None:
    """A message with no visible ASCII character is read character by character (the C check
    for one settles most messages): visible text in any script is a message."""
    agent = sqlite_agent(database, ScriptedModel(lambda call: "ok"))
    reply = await agent.handle("s1", "u1", text)
    assert reply.status == "completed", reply
    state = agent.session_state("s1")
    assert state is not None and state.messages[0].content == text


async def test_lone_surrogates_from_the_user_and_the_model_are_stored_safely(
    database: SQLiteDatabase,
) -> None:
    agent = sqlite_agent(database, ScriptedModel(lambda call: "broken \ud800 reply"))
    reply = await agent.handle("s1", "u1", "hello \udfff there")
    assert reply.status == "completed"
    assert "\ud800" not in reply.text
    state = agent.session_state("s1")
    assert state is not None and state.runtime.open_turn is None
    assert [m.content for m in state.messages] == ["hello \ufffd there", "broken \ufffd reply"]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("choices")])
async def test_a_custom_model_raising_anything_ends_the_turn_cleanly(
    database: SQLiteDatabase, error: Exception
) -> None:
    agent = sqlite_agent(database, ScriptedModel([error], repeat_last=True))
    reply = await agent.handle("s1", "u1", "hello")
    assert reply.status == "model_failed"
    assert type(error).__name__ in (reply.error or "")
    state = agent.session_state("s1")
    assert state is not None and state.runtime.open_turn is None


# --- 14. a reply that was never saved is never shown to the model ---------------------------


async def test_a_failed_commit_leaves_no_unsaved_reply_in_the_next_prompt(
    database: SQLiteDatabase,
) -> None:
    prompts: list[list[str]] = []

    def answers(call: ScriptedCall) -> str:
        prompts.append([m.content for m in call.messages])
        return f"answer to {call.last_user_text}"

    agent = sqlite_agent(database, ScriptedModel(answers))
    await agent.handle("s1", "u1", "one")
    original, original_append = agent.state.acheckpoint, agent.state.aappend

    async def failing_commit(session_id: str, state: AgentState, **options: object) -> int:
        if options.get("reason") == "turn completed":
            raise StoreError("disk full")
        return await original(session_id, state, **options)  # type: ignore[arg-type]

    async def failing_append(session_id: str, append: object, **options: object) -> int:
        if options.get("reason") == "turn completed":
            raise StoreError("disk full")
        return await original_append(session_id, append, **options)  # type: ignore[arg-type]

    agent.state.acheckpoint = failing_commit  # type: ignore[method-assign]
    agent.state.aappend = failing_append  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        await agent.handle("s1", "u1", "two")
    agent.state.acheckpoint = original  # type: ignore[method-assign]
    agent.state.aappend = original_append  # type: ignore[method-assign]
    await agent.handle("s1", "u1", "three")
    # "two" was left open by the failed commit and is finished before "three"; the reply that
    # was never saved is not in the prompt next to the one that was.
    assert prompts[-1] == ["You help.", "one", "answer to one", "two", "answer to two", "three"]


# --- 17. progress without a state machine ---------------------------------------------------


async def test_many_different_tool_calls_without_a_machine_are_progress(
    database: SQLiteDatabase,
) -> None:
    def make(name: str) -> Tool:
        def lookup(q: str) -> str:
            return f"{name} result for {q}"

        lookup.__name__ = name
        lookup.__doc__ = f"Look up in {name}.\n\nArgs:\n    q: The query.\n"
        return tool(lookup)

    tools = [make(f"source_{n}") for n in range(12)]

    def twelve_lookups(call: ScriptedCall) -> Message | str:
        done = sum(m.role == "tool" for m in call.messages)
        if done < 12:
            return ScriptedModel.tool_call(f"source_{done}", json.dumps({"q": f"topic {done}"}))
        return "Here is everything."

    agent = sqlite_agent(
        database, ScriptedModel(twelve_lookups), tools=tools, guards=GuardConfig(max_steps=20)
    )
    reply = await agent.handle("s1", "u1", "research this")
    assert reply.status == "completed", reply.error
    assert reply.steps == 13


# --- 19. the whole turn within the time limit; the answer's limit is the room left ----------


@pytest.mark.parametrize("history_words", [0, 2_000])
async def test_the_answer_may_take_what_the_window_leaves_never_less_than_the_reserve(
    database: SQLiteDatabase, history_words: int
) -> None:
    model = ScriptedModel(lambda call: "ok")
    agent = sqlite_agent(database, model, context=ContextBudget(working_budget=4_000))
    if history_words:
        await agent.handle("s1", "u1", "lorem " * history_words)
    reply = await agent.handle("s1", "u1", "hello")
    budget = agent.engine.budget
    sent = model.calls[-1]
    prompt_tokens = agent.model.counter.count_prompt(sent.messages, sent.tools)
    assert prompt_tokens == reply.max_prompt_tokens
    # The prompt never takes the reserve; the answer gets all the prompt left, not the reserve.
    assert prompt_tokens + budget.reserve <= budget.effective_window
    assert sent.options.max_tokens == budget.effective_window - prompt_tokens
    assert sent.options.max_tokens >= budget.reserve


async def test_the_time_limit_covers_memory_retrieval_and_commit(
    database: SQLiteDatabase,
) -> None:
    model = ScriptedModel(lambda call: "ok", delay_s=0.3)
    agent = sqlite_agent(database, model, guards=GuardConfig(run_timeout_s=1.0, model_timeout_s=5))

    class SlowMemories:
        async def recall(self, user_id: str, query: str, shown: object) -> list[object]:
            await asyncio.sleep(0.8)
            return []

    agent._hand_off = SlowMemories()  # type: ignore[assignment]
    reply = await agent.handle("s1", "u1", "hello")
    # The loop got what was left of the turn's second (too little for a 0.3 s model call),
    # not a fresh second of its own.
    assert reply.status == "time_limit"


async def test_a_turn_that_lost_its_lease_runs_no_side_effect(database: SQLiteDatabase) -> None:
    """A worker that stalled past its lease while another took the session over must not
    book: the lease is renewed, and found taken, right before the effect."""
    book, effects = _booking()
    agent: Agent

    def stalls_then_books(call: ScriptedCall) -> Message | str:
        key = f"session:{agent.session_key('s1')}"
        with database.transaction() as conn:
            conn.execute("DELETE FROM keel_state_locks WHERE key = ?", (key,))
        assert agent.state.backend.acquire_lock(key, "another-worker", 30, 1e12)
        return ScriptedModel.tool_call("book", json.dumps({"ref": "LATE1"}))

    agent = sqlite_agent(database, ScriptedModel(stalls_then_books), tools=[book])
    with pytest.raises(ConflictError, match="interrupted"):
        await agent.handle("s1", "u1", "book LATE1")
    assert effects == []
    assert SQLToolJournal(database).entries() == []


async def test_a_turn_ends_even_when_the_lease_renewal_swallows_its_cancellation(
    database: SQLiteDatabase,
) -> None:
    """The turn stops its lease heartbeat when it ends. A client library can swallow the cancel
    that lands mid-renewal (asyncio.wait_for before Python 3.12 loses one that races the
    command's result; ``keel bench serve`` hung on Redis this way): the turn must still end."""
    agent = sqlite_agent(database, ScriptedModel(["Noted."], delay_s=0.3), lease_ttl_s=0.15)
    lock = agent.state.session_lock(agent.session_key("s1"), ttl=0.15)
    renewals = 0
    unstick = False

    class SwallowsCancel(type(lock)):  # type: ignore[misc]
        async def aacquire(self, wait: float = 0.0) -> bool:
            nonlocal renewals
            if not self.held:
                return await super().aacquire(wait)
            renewals += 1
            with contextlib.suppress(asyncio.CancelledError):  # swallowed, as the race does
                await asyncio.sleep(1)
            return not unstick

    lock.__class__ = SwallowsCancel
    agent.state.session_lock = lambda key, ttl=30.0: lock  # type: ignore[method-assign]
    turn = asyncio.ensure_future(agent.handle("s1", "u1", "hello"))
    # The wait only tells a hang from a failure; the turn takes about 0.3 s.
    done, _ = await asyncio.wait({turn}, timeout=30)
    if not done:
        unstick = True  # the next renewal reports the lease lost, which ends the heartbeat
        await turn
        pytest.fail("the turn never ended: its heartbeat kept renewing the lease")
    assert turn.result().status == "completed"
    assert renewals >= 1, "the heartbeat never renewed: the test did not exercise it"


@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_on_server_backends_sessions_are_scoped_and_owned_one_turn_at_a_time(
    request: pytest.FixtureRequest, backend: str
) -> None:
    from keel.stores import PostgresDatabase, SQLToolJournal
    from keel.testing._state_worker import state_backend_at

    url = request.getfixturevalue("postgres_url" if backend == "postgres" else "redis_url")
    journal_url = url if backend == "postgres" else request.getfixturevalue("postgres_url")
    book, effects = _booking()
    with PostgresDatabase(journal_url, max_size=4) as journal_database:
        journal = SQLToolJournal(journal_database)
        state_backend = state_backend_at(url)

        def agent_for(tenant: str) -> Agent:
            return Agent(
                ScriptedModel(_books_then_answers),
                state=StateStore(state_backend, AgentState),
                system_prompt="You help.",
                tools=[book],
                journal=journal,
                tenant_id=tenant,
                lease_ttl_s=5,
            )

        acme, evil = agent_for("acme"), agent_for("evil")
        replies = await asyncio.gather(
            *(acme.handle("s1", "alice", f"book A{n}") for n in range(4)),
            evil.handle("s1", "mallory", "hello"),
        )
        assert all(reply.status == "completed" for reply in replies)
        assert sorted(effects) == ["A0", "A1", "A2", "A3"]
        with pytest.raises(AccessDeniedError):
            await acme.handle("s1", "mallory", "hi")
        mine = acme.session_state("s1")
        theirs = evil.session_state("s1")
        assert mine is not None and theirs is not None
        assert len([m for m in mine.messages if m.role == "user"]) == 4
        assert [m.content for m in theirs.messages if m.role == "user"] == ["hello"]
        await state_backend.aclose()


async def test_a_tool_the_workflow_step_does_not_allow_is_refused_before_the_journal(
    database: SQLiteDatabase,
) -> None:
    from keel.state import MachineState, StateMachine, Transition

    book, effects = _booking()
    machine = StateMachine(
        "shop",
        states=[
            MachineState("browsing", "looking around", "Help the user choose.", ()),
            MachineState("paying", "paying", "Book what the user chose.", ("book",)),
            MachineState("done", "done", "Say goodbye.", (), terminal=True),
        ],
        transitions=[Transition("browsing", "paying"), Transition("paying", "done")],
        initial="browsing",
    )

    def eager(call: ScriptedCall) -> Message | str:
        results = [m for m in call.messages if m.role == "tool"]
        if not results:
            return ScriptedModel.tool_call("book", json.dumps({"ref": "TOO-SOON"}))
        if len(results) == 1:
            return ScriptedModel.tool_call("go_to", json.dumps({"step": "paying"}))
        if len(results) == 2:
            return ScriptedModel.tool_call("book", json.dumps({"ref": "NOW"}))
        return "Booked."

    agent = Agent(
        ScriptedModel(eager),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You sell.",
        tools=[book],
        machine=machine,
        journal=SQLToolJournal(database),
    )
    reply = await agent.handle("s1", "u1", "I want it")
    assert reply.status == "completed", reply.error
    assert effects == ["NOW"]
    assert reply.effects == ("book",), "the refused call is no effect"
    journalled = SQLToolJournal(database).entries()
    assert [entry.arguments for entry in journalled] == ['{"ref": "NOW"}']


async def test_the_session_cache_is_bounded_and_an_evicted_session_is_rebuilt(
    database: SQLiteDatabase,
) -> None:
    prompts: list[list[str]] = []

    def answers(call: ScriptedCall) -> str:
        prompts.append([m.content for m in call.messages])
        return f"Noted: {call.last_user_text}."

    agent = sqlite_agent(database, ScriptedModel(answers), session_cache_size=2)
    for session in ("a", "b", "c"):
        await agent.handle(session, "u1", f"hello from {session}")
    assert len(agent._logs) == 2
    assert agent.session_key("a") not in agent._logs
    await agent.handle("a", "u1", "again")
    assert prompts[-1] == ["You help.", "hello from a", "Noted: hello from a.", "again"]
