"""keel's LangGraph checkpointer: LangGraph's own conformance suite on SQLite, PostgreSQL and
Redis, then what keel adds (a stale writer rejected, retention that keeps resume working, PII
masked, storage that grows with what changed), through real LangGraph graphs."""

from __future__ import annotations

import asyncio
import contextlib
import operator
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from keel.errors import StoreError
from keel.integrations.langgraph import KeelCheckpointSaver, StaleWriterError
from keel.privacy import DEFAULT_MASKER
from keel.testing.langgraph import conformance_failures


def test_the_conformance_suite_passes_in_full_on_sqlite(tmp_path: Path) -> None:
    assert conformance_failures(f"sqlite:///{tmp_path / 'lg.db'}") == {}


def test_the_conformance_suite_passes_in_full_on_postgres(postgres_url: str) -> None:
    assert conformance_failures(postgres_url) == {}


def test_the_conformance_suite_passes_in_full_on_redis(redis_url: str) -> None:
    assert conformance_failures(redis_url) == {}


# --- real graphs --------------------------------------------------------------------------------


class Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]
    steps: Annotated[int, operator.add]


def _echo_graph(
    saver: KeelCheckpointSaver,
    gate: threading.Event | None = None,
    entered: threading.Event | None = None,
) -> Any:
    def reply(state: Chat) -> dict[str, Any]:
        if entered is not None:
            entered.set()
        if gate is not None:
            gate.wait(timeout=30)
        last = state["messages"][-1].content
        return {"messages": [AIMessage(content=f"echo: {last}")], "steps": 1}

    graph = StateGraph(Chat)
    graph.add_node("reply", reply)
    graph.add_edge(START, "reply")
    return graph.compile(checkpointer=saver)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keel.db'}"


@pytest.fixture
def saver(db_url: str) -> Iterator[KeelCheckpointSaver]:
    with KeelCheckpointSaver(db_url) as opened:
        yield opened


def _thread(thread_id: str = "t1") -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def test_a_graph_resumes_its_thread_from_another_process_view(db_url: str) -> None:
    with KeelCheckpointSaver(db_url) as first:
        graph = _echo_graph(first)
        for text in ("one", "two", "three"):
            graph.invoke({"messages": [HumanMessage(content=text)], "steps": 0}, _thread())
    with KeelCheckpointSaver(db_url) as second:
        state = _echo_graph(second).invoke(
            {"messages": [HumanMessage(content="four")], "steps": 0}, _thread()
        )
        assert [m.content for m in state["messages"]] == [
            "one",
            "echo: one",
            "two",
            "echo: two",
            "three",
            "echo: three",
            "four",
            "echo: four",
        ]
        assert state["steps"] == 4
        history = list(_echo_graph(second).get_state_history(_thread()))
        assert len(history) == 4 * 3  # input, loop step, and the step after it, per turn


class _ReadThenWait(KeelCheckpointSaver):
    """A saver whose run reads the thread, then waits for the test before going on."""

    def __init__(self, url: str, gate: threading.Event) -> None:
        super().__init__(url)
        self.gate = gate
        self.has_read = threading.Event()

    def get_tuple(self, config: Any) -> Any:
        found = super().get_tuple(config)
        self.has_read.set()
        self.gate.wait(timeout=30)
        return found


def _in_background(run: Any) -> tuple[threading.Thread, list[BaseException]]:
    failure: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, failure


def _everything_stored(saver: KeelCheckpointSaver) -> str:
    """Every checkpoint's values and pending writes of thread t1, as one text."""
    return " ".join(
        f"{t.checkpoint['channel_values']} {t.pending_writes}" for t in saver.list(_thread())
    )


def test_a_writer_whose_thread_moved_on_is_rejected_and_stores_nothing(db_url: str) -> None:
    gate = threading.Event()
    with KeelCheckpointSaver(db_url) as a, _ReadThenWait(db_url, gate) as b:
        _echo_graph(a).invoke({"messages": [HumanMessage(content="hello")], "steps": 0}, _thread())
        b_run, failure = _in_background(
            lambda: _echo_graph(b).invoke(
                {"messages": [HumanMessage(content="from b")], "steps": 0}, _thread()
            )
        )
        assert b.has_read.wait(timeout=30)
        # B has read the thread's latest checkpoint; A stores a whole turn after it.
        _echo_graph(a).invoke({"messages": [HumanMessage(content="from a")], "steps": 0}, _thread())
        gate.set()
        b_run.join(timeout=60)
        assert failure and isinstance(failure[0], StaleWriterError), failure
        texts = [m.content for m in _echo_graph(a).get_state(_thread()).values["messages"]]
        assert texts == ["hello", "echo: hello", "from a", "echo: from a"]
        assert "from b" not in _everything_stored(a)


def test_a_step_result_of_a_superseded_run_is_never_visible(db_url: str) -> None:
    gate, entered = threading.Event(), threading.Event()
    with KeelCheckpointSaver(db_url) as a, KeelCheckpointSaver(db_url) as b:
        _echo_graph(a).invoke({"messages": [HumanMessage(content="hello")], "steps": 0}, _thread())
        # B stores its input, then waits inside its step; A runs a whole turn meanwhile. B saves
        # synchronously, so once its step has started every checkpoint before the step is stored
        # and A's turn cannot interleave with one of them.
        b_run, failure = _in_background(
            lambda: _echo_graph(b, gate, entered).invoke(
                {"messages": [HumanMessage(content="from b")], "steps": 0},
                _thread(),
                durability="sync",
            )
        )
        assert entered.wait(timeout=30)
        assert "from b" in _everything_stored(a)
        _echo_graph(a).invoke({"messages": [HumanMessage(content="from a")], "steps": 0}, _thread())
        gate.set()
        b_run.join(timeout=60)
        assert failure and isinstance(failure[0], StaleWriterError), failure
        assert "echo: from b" not in _everything_stored(a)
        texts = [m.content for m in _echo_graph(a).get_state(_thread()).values["messages"]]
        assert texts[-1] == "echo: from a" and texts.count("echo: from a") == 1


def test_keep_latest_keeps_resume_working_and_storage_small(saver: KeelCheckpointSaver) -> None:
    graph = _echo_graph(saver)
    for turn in range(5):
        graph.invoke({"messages": [HumanMessage(content=f"turn {turn}")], "steps": 0}, _thread())
    assert len(list(graph.get_state_history(_thread()))) == 15
    saver.prune(["t1"], strategy="keep_latest")
    assert len(list(graph.get_state_history(_thread()))) == 1
    state = graph.invoke({"messages": [HumanMessage(content="after")], "steps": 0}, _thread())
    assert [m.content for m in state["messages"]][-2:] == ["after", "echo: after"]
    assert len(state["messages"]) == 12 and state["steps"] == 6


def test_a_thread_expires_as_a_whole_after_its_ttl(db_url: str) -> None:
    now = [1_000_000.0]
    with KeelCheckpointSaver(db_url, ttl=60, clock=lambda: now[0]) as saver:
        graph = _echo_graph(saver)
        graph.invoke({"messages": [HumanMessage(content="a")], "steps": 0}, _thread())
        now[0] += 59
        graph.invoke({"messages": [HumanMessage(content="b")], "steps": 0}, _thread())
        now[0] += 59  # within the ttl of the last write: still whole
        assert len(graph.get_state(_thread()).values["messages"]) == 4
        now[0] += 2
        assert saver.get_tuple(_thread()) is None
        saver.vacuum()
        # The namespace and every index entry naming it are gone: nothing of the thread left.
        assert saver.store.sessions() == []
        assert list(saver.list(_thread())) == []


def test_pii_is_masked_before_it_is_stored(db_url: str, tmp_path: Path) -> None:
    with KeelCheckpointSaver(db_url) as saver:
        graph = _echo_graph(saver)
        graph.invoke(
            {"messages": [HumanMessage(content="mail me at jane.doe@example.com")], "steps": 0},
            _thread(),
        )
        restored = saver.get_tuple(_thread())
        assert restored is not None
        texts = [m.content for m in restored.checkpoint["channel_values"]["messages"]]
        # No key given, the saver keeps the value in the vault under keel's own key file
        # (as Backends.open does on SQLite): the thread's user reads it back.
        assert texts[0] == "mail me at jane.doe@example.com"
    raw = (tmp_path / "keel.db").read_bytes()
    for wal in tmp_path.glob("keel.db-wal"):
        raw += wal.read_bytes()
    assert b"jane.doe" not in raw
    rows = sqlite3.connect(tmp_path / "keel.db").execute(
        "SELECT payload FROM keel_state_checkpoints"
    )
    assert all("jane.doe" not in str(row[0]) for row in rows)


def test_the_default_masker_is_keels_one_default_policy(saver: KeelCheckpointSaver) -> None:
    # The default policy is built once for the process, not again by each saver.
    assert saver.masker is DEFAULT_MASKER


def test_a_growing_thread_stores_what_changed_not_the_whole_list_again(
    saver: KeelCheckpointSaver,
) -> None:
    graph = _echo_graph(saver)
    padding = "x" * 2_000
    sizes = []
    for turns in (20, 20):
        for turn in range(turns):
            graph.invoke(
                {"messages": [HumanMessage(content=f"{turn} {padding}")], "steps": 0}, _thread()
            )
        sizes.append(
            sum(info.size_bytes for info in saver.store.history(saver._names.session("t1", "")))
        )
    # Twice the turns, about twice the bytes: linear (whole lists per checkpoint: about 4x).
    assert sizes[1] / sizes[0] < 2.5, sizes


def test_the_first_run_to_store_a_checkpoint_keeps_only_its_own_writes_on_the_parent(
    db_url: str,
) -> None:
    """Two runs read the same latest checkpoint and both store the same task's writes on it;
    the one that stores the next checkpoint first wins, and the parent's pending writes are
    then the winner's alone (the loser's result is nowhere to be read)."""
    with KeelCheckpointSaver(db_url) as a, KeelCheckpointSaver(db_url) as b:
        graph = _echo_graph(a)
        graph.invoke({"messages": [HumanMessage(content="hello")], "steps": 0}, _thread())
        read_a, read_b = a.get_tuple(_thread()), b.get_tuple(_thread())
        assert read_a is not None and read_b is not None
        b.put_writes(read_b.config, [("messages", "result of b")], "task-1")
        a.put_writes(read_a.config, [("messages", "result of a")], "task-1")
        child = dict(read_a.checkpoint)
        child["id"] = "2" + read_a.checkpoint["id"][1:]  # a newer id, as uuid6 orders them
        a.put(read_a.config, child, {"source": "loop", "step": 9}, {})  # type: ignore[arg-type]
        with pytest.raises(StaleWriterError):
            b.put_writes(read_b.config, [("steps", 1)], "task-2")
        with pytest.raises(StaleWriterError):
            b.put(read_b.config, dict(read_b.checkpoint, id="3" + child["id"][1:]), {}, {})  # type: ignore[arg-type]
        parent = a.get_tuple({"configurable": {**read_a.config["configurable"]}})
        assert parent is not None
        assert [w[2] for w in parent.pending_writes or []] == ["result of a"]
        latest = b.get_tuple(_thread())
        assert latest is not None and latest.checkpoint["id"] == child["id"]


def test_connections_of_ended_threads_are_taken_over_not_piled_up(
    saver: KeelCheckpointSaver,
) -> None:
    """LangGraph's executor runs each invocation's saves on threads of its own; a thread that
    has ended leaves its SQLite connection to the next one instead of one more staying open."""
    graph = _echo_graph(saver)
    database = saver.backend.db  # type: ignore[attr-defined]
    for turn in range(30):
        graph.invoke({"messages": [HumanMessage(content=f"t{turn}")], "steps": 0}, _thread())
    assert len(database._connections) <= 10


_PROCESS_B = """
import sys, time
from pathlib import Path
from langchain_core.messages import HumanMessage
sys.path.insert(0, sys.argv[3])
from test_langgraph_checkpointer import _ReadThenWait, _echo_graph, _thread
from keel.integrations.langgraph import StaleWriterError
import threading

gate = threading.Event()
saver = _ReadThenWait(sys.argv[1], gate)
signal = Path(sys.argv[2])

def release():
    saver.has_read.wait(30)
    (signal.parent / "b-has-read").touch()
    while not signal.exists():
        time.sleep(0.01)
    gate.set()

threading.Thread(target=release, daemon=True).start()
try:
    _echo_graph(saver).invoke({"messages": [HumanMessage(content="from b")], "steps": 0}, _thread())
except StaleWriterError:
    print("stale")
else:
    print("stored")
"""


def test_a_second_process_on_a_moved_on_thread_is_rejected(db_url: str, tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    with KeelCheckpointSaver(db_url) as a:
        graph = _echo_graph(a)
        graph.invoke({"messages": [HumanMessage(content="hello")], "steps": 0}, _thread())
        signal = tmp_path / "a-is-done"
        process = subprocess.Popen(
            [sys.executable, "-c", _PROCESS_B, db_url, str(signal), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "b-has-read").exists():
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            graph.invoke({"messages": [HumanMessage(content="from a")], "steps": 0}, _thread())
            signal.touch()
            out, _ = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert out.strip() == "stale"
        texts = [m.content for m in graph.get_state(_thread()).values["messages"]]
        assert texts == ["hello", "echo: hello", "from a", "echo: from a"]
        assert "from b" not in _everything_stored(a)


def test_a_send_that_carries_the_state_stores_references_not_a_copy(
    saver: KeelCheckpointSaver,
) -> None:
    """LangGraph's prebuilt ReAct agent sends the tool node a ``Send`` carrying the whole
    state, every turn; stored as a copy, a thread's bytes would grow with its square."""
    from keel.bench._react import ANSWER, question, react_agent

    graph, _ = react_agent(saver)
    sizes = []
    for start in (0, 20):
        for turn in range(start, start + 20):
            out = graph.invoke({"messages": [("user", question(turn))]}, _thread())
            assert out["messages"][-1].content == ANSWER
        sizes.append(
            sum(info.size_bytes for info in saver.store.history(saver._names.session("t1", "")))
        )
    assert sizes[1] / sizes[0] < 2.5, sizes
    assert len(graph.get_state(_thread()).values["messages"]) == 4 * 40


def test_writes_stored_after_their_checkpoint_stopped_being_the_head_are_kept(
    saver: KeelCheckpointSaver,
) -> None:
    """LangGraph saves in the background: a task's write to checkpoint P can land after P's
    child is stored (a late write), and a fork's first writes go to an older checkpoint.
    Either way they are P's pending writes from then on, whatever is stored after."""
    from langgraph.checkpoint.base import empty_checkpoint

    def put(parent: dict[str, Any] | None, checkpoint_id: str) -> dict[str, Any]:
        config = {"configurable": {"thread_id": "t1", "checkpoint_ns": ""}}
        if parent is not None:
            config["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
        checkpoint = empty_checkpoint()
        checkpoint["id"] = checkpoint_id
        return saver.put(config, checkpoint, {"source": "loop", "step": 0}, {})  # type: ignore[arg-type]

    def writes_of(config: dict[str, Any]) -> list[Any]:
        found = saver.get_tuple(config)  # type: ignore[arg-type]
        assert found is not None
        return [w[2] for w in found.pending_writes or []]

    p = put(None, "1")
    x = put(p, "2")
    saver.put_writes(p, [("messages", "late")], "task-p")  # type: ignore[arg-type]
    y = put(x, "3")
    assert writes_of(p) == ["late"]
    saver.put_writes(p, [("messages", "fork's first")], "task-f")  # type: ignore[arg-type]
    put(p, "4")  # the fork's checkpoint, a child of P
    put(y, "5")
    assert sorted(writes_of(p)) == ["fork's first", "late"]
    assert writes_of(y) == [] and writes_of(x) == []


def test_an_async_graph_on_postgres_resumes_and_lists_its_history(postgres_url: str) -> None:
    """The async twins, through LangGraph's own ``ainvoke`` and ``aget_state_history``."""

    async def scenario() -> tuple[list[str], int]:
        with KeelCheckpointSaver(postgres_url) as saver:
            graph = _echo_graph(saver)
            for text in ("one", "two"):
                await graph.ainvoke(
                    {"messages": [HumanMessage(content=text)], "steps": 0}, _thread()
                )
        with KeelCheckpointSaver(postgres_url) as reopened:
            graph = _echo_graph(reopened)
            state = await graph.ainvoke(
                {"messages": [HumanMessage(content="three")], "steps": 0}, _thread()
            )
            history = [snapshot async for snapshot in graph.aget_state_history(_thread())]
        return [m.content for m in state["messages"]], len(history)

    texts, checkpoints = asyncio.run(scenario())
    assert texts == ["one", "echo: one", "two", "echo: two", "three", "echo: three"]
    assert checkpoints == 3 * 3


# --- time travel ----------------------------------------------------------------------------


def _texts_or_error(run: Any) -> list[str] | str:
    """The messages a graph call leaves, or the name of the error it raised instead."""
    try:
        values = run()
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    messages = values["messages"] if isinstance(values, dict) else values.values["messages"]
    return [m.content for m in messages]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_config_from_get_state_forks_after_the_thread_moved_on(
    backend: str, db_url: str, request: pytest.FixtureRequest
) -> None:
    """``get_state``'s config names its checkpoint: running from it, or updating it, once the
    thread has moved on is a fork (as LangGraph's own savers do), not a stale writer. A run
    that read "the latest" is still fenced (the tests above)."""
    url = request.getfixturevalue("postgres_url") if backend == "postgres" else db_url
    with KeelCheckpointSaver(url) as saver:
        graph = _echo_graph(saver)
        graph.invoke({"messages": [HumanMessage(content="one")], "steps": 0}, _thread())
        snapshot = graph.get_state(_thread())
        graph.invoke({"messages": [HumanMessage(content="two")], "steps": 0}, _thread())

        forked = _texts_or_error(
            lambda: graph.invoke(
                {"messages": [HumanMessage(content="fork")], "steps": 0}, snapshot.config
            )
        )
        assert forked == ["one", "echo: one", "fork", "echo: fork"]
        assert _texts_or_error(lambda: graph.get_state(_thread())) == forked

        graph.invoke({"messages": [HumanMessage(content="three")], "steps": 0}, _thread())
        updated = _texts_or_error(
            lambda: graph.get_state(
                graph.update_state(snapshot.config, {"messages": [HumanMessage(content="edit")]})
            )
        )
        assert updated == ["one", "echo: one", "edit"]
        # Every branch stays in the thread's history.
        ends = {tuple(_texts_or_error(lambda s=s: s)) for s in graph.get_state_history(_thread())}
        assert ("one", "echo: one", "two", "echo: two") in ends
        assert ("one", "echo: one", "fork", "echo: fork", "three", "echo: three") in ends


def test_an_async_graph_opens_and_closes_the_saver_with_async_with(db_url: str) -> None:
    """As LangGraph's own async savers are used (``async with ... as saver``); it was a
    TypeError, so async code had to close the saver by hand."""
    opened = KeelCheckpointSaver(db_url)
    assert isinstance(opened, contextlib.AbstractAsyncContextManager)

    async def main() -> dict[str, Any]:
        async with opened as saver:
            graph = _echo_graph(saver)
            result: dict[str, Any] = await graph.ainvoke(
                {"messages": [HumanMessage("hi")], "steps": 0}, _thread()
            )
            return result

    assert asyncio.run(main())["messages"][-1].content == "echo: hi"
    with pytest.raises(StoreError, match="is closed"):  # the database it opened, released
        opened.get_tuple(_thread())
    with KeelCheckpointSaver(db_url) as again:
        assert again.get_tuple(_thread()) is not None
