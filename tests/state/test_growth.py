"""A growing state costs each checkpoint its new part: validation, storage and snapshots."""

from __future__ import annotations

import gc
import json
import sqlite3
import tracemalloc
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from keel.errors import ConflictError, StateValidationError, UsageError
from keel.messages import Message
from keel.state import AgentState, StateSchema, StateStore, _codec, _delta, add_messages, append
from keel.state._delta import encode_full, encode_json
from keel.testing._state_models import ConversationState, CounterState
from keel.testing._state_worker import state_backend_at

_checked: list[str] = []


class Entry(BaseModel):
    """A frozen item whose validator records every run."""

    model_config = ConfigDict(frozen=True)

    text: str

    @model_validator(mode="after")
    def _count(self) -> Entry:
        _checked.append(self.text)
        return self


class Journal(BaseModel):
    entries: Annotated[list[Entry], append] = Field(default_factory=list)
    step: int = 0


class AtMostThree(AgentState):
    """A model validator of the application's own: it must see the whole list every time."""

    @model_validator(mode="after")
    def _short(self) -> AtMostThree:
        if len(self.messages) > 3:
            raise ValueError(f"{len(self.messages)} messages, at most 3")
        return self


def _store(tmp_path: Path, schema: Any, **options: Any) -> StateStore[Any]:
    return StateStore(state_backend_at(f"sqlite:///{tmp_path / 'g.db'}"), schema, **options)


def test_appended_items_alone_are_validated(tmp_path: Path) -> None:
    store = _store(tmp_path, Journal)
    entries = [Entry(text=f"e{k}") for k in range(5)]
    version = store.create("j", Journal(entries=entries)).version
    fifth, sixth = Entry(text="e5"), Entry(text="e6")
    _checked.clear()
    entries.append(fifth)
    version = store.checkpoint("j", {"entries": entries}, expected_version=version, reason="r")
    cp = store.update("j", {"entries": [sixth]}, expected_version=version)
    assert _checked == ["e5", "e6"]
    assert [e.text for e in cp.state.entries] == [f"e{k}" for k in range(7)]
    fresh = _store(tmp_path, Journal)
    assert fresh.load("j").state == cp.state
    store.close()
    fresh.close()


def test_a_model_validator_of_a_subclass_still_sees_the_whole_state(tmp_path: Path) -> None:
    assert StateSchema(AtMostThree).extensible_lists == frozenset()
    store = _store(tmp_path, AtMostThree)
    messages = [Message.user("a"), Message.assistant("b")]
    version = store.create("s", AtMostThree(messages=messages)).version
    messages.append(Message.user("c"))
    state = AtMostThree.model_construct(messages=list(messages))
    version = store.checkpoint("s", state, expected_version=version, reason="r")
    messages.append(Message.assistant("d"))
    with pytest.raises(StateValidationError, match="4 messages, at most 3"):
        store.checkpoint("s", {"messages": list(messages)}, expected_version=version, reason="r")
    assert len(store.load("s").state.messages) == 3
    store.close()


def test_an_invalid_appended_message_is_rejected_as_in_a_whole_state(tmp_path: Path) -> None:
    schema = StateSchema(AgentState)
    store = _store(tmp_path, schema)
    messages = [Message.user(f"q{k}") for k in range(4)]
    version = store.create("s", AgentState(messages=messages)).version
    # model_construct skips validation: the role check has to run when the state is validated.
    broken = Message.model_construct(role="tool", content="no call id")
    cases: list[list[Any]] = [
        [*messages, Message.assistant("fine"), broken],
        [*messages, {"role": "nobody"}],
    ]
    for candidate in cases:
        with pytest.raises(StateValidationError) as whole:
            schema.validate({"messages": candidate})
        with pytest.raises(StateValidationError) as appended:
            store.checkpoint("s", {"messages": candidate}, expected_version=version, reason="r")
        assert str(appended.value) == str(whole.value)
        assert f"messages.{len(candidate) - 1}" in str(appended.value)
    with pytest.raises(StateValidationError, match="past max_steps"):
        store.checkpoint(
            "s",
            {"messages": [*messages, Message.user("x")], "step": 60},
            expected_version=version,
            reason="r",
        )
    assert store.load("s").version == version
    store.close()


class _WithOwnInit(AgentState):
    def __init__(self, **data: Any) -> None:
        super().__init__(**data)


class _WithPostInit(AgentState):
    def model_post_init(self, context: Any) -> None:
        pass


class _Bounded(AgentState):
    messages: Annotated[list[Message], add_messages] = Field(default_factory=list, max_length=9)


class _ListValidator(AgentState):
    @field_validator("messages")
    @classmethod
    def _few(cls, value: list[Message]) -> list[Message]:
        return value


class _ReadsOtherFields(AgentState):
    note: str = ""

    @field_validator("note")
    @classmethod
    def _note(cls, value: str, info: ValidationInfo) -> str:
        return f"{value}{len(info.data['messages'])}"


@pytest.mark.parametrize(
    ("model", "extensible"),
    [
        (AgentState, {"messages"}),
        (ConversationState, {"messages"}),
        (CounterState, {"items"}),
        (AtMostThree, set()),
        (_WithOwnInit, set()),
        (_WithPostInit, set()),
        (_Bounded, set()),
        (_ListValidator, set()),
        (_ReadsOtherFields, set()),
    ],
)
def test_lists_are_validated_by_their_tail_only_where_nothing_else_reads_them(
    model: type[BaseModel], extensible: set[str]
) -> None:
    assert StateSchema(model).extensible_lists == extensible


def test_a_list_changed_in_place_after_a_checkpoint_is_stored_as_it_now_is(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, AgentState)
    state = AgentState(messages=[Message.user("a"), Message.assistant("b")])
    version = store.create("s", state).version
    state.messages.append(Message.user("c"))
    version = store.checkpoint("s", state, expected_version=version, reason="r")
    # The caller edits the list it checkpointed: the next delta must see the edit.
    state.messages[0] = Message.user("edited")
    state.messages.append(Message.assistant("d"))
    version = store.checkpoint("s", state, expected_version=version, reason="r")
    expected = ["edited", "b", "c", "d"]
    assert [m.content for m in store.load("s").state.messages] == expected
    fresh = _store(tmp_path, AgentState)
    assert [m.content for m in fresh.load("s").state.messages] == expected
    assert [m.content for m in fresh.at("s", 2).state.messages] == ["a", "b", "c"]
    store.close()
    fresh.close()


def test_snapshots_of_a_growing_list_keep_storage_linear(tmp_path: Path) -> None:
    store = _store(tmp_path, ConversationState, snapshot_every=10)
    version = store.create("c", ConversationState()).version
    for k in range(1, 601):
        message = Message.user(f"message {k} " + "x" * 150)
        version = store.update(
            "c", {"messages": [message], "step": k}, expected_version=version
        ).version
    history = store.history("c")
    deltas = sum(h.size_bytes for h in history if h.kind == "delta")
    fulls = [h for h in history if h.kind == "full"]
    # A snapshot every 10 versions would store ~60 copies of a growing list (~3.6 MB, 30x the
    # deltas); snapshots sized by the deltas since the last one stay within a few times them.
    assert sum(h.size_bytes for h in history) < 4 * deltas
    assert len(fulls) < 15
    fresh = _store(tmp_path, ConversationState)
    for probe in (1, 2, 11, 12, 300, 301, 599, 600, 601):
        state = fresh.at("c", probe).state
        assert len(state.messages) == probe - 1 and state.step == probe - 1
    assert fresh.load("c").state == store.load("c").state
    store.close()
    fresh.close()


def _appended_with_encoded_chars(
    store: StateStore[Any], versions: int, monkeypatch: pytest.MonkeyPatch
) -> dict[int, int]:
    """Append a message per version to a new session ``c``; the characters of JSON the
    codec encoded for each version's write."""
    encoded: dict[int, int] = {}
    current = {"version": 0}

    def counting(value: Any) -> str:
        text = encode_json(value)
        encoded[current["version"]] = encoded.get(current["version"], 0) + len(text)
        return text

    monkeypatch.setattr(_codec, "encode_json", counting)
    monkeypatch.setattr(_delta, "encode_json", counting)
    version = store.create("c", ConversationState()).version
    for k in range(1, versions + 1):
        current["version"] = version + 1
        message = Message.user(f"message {k} " + "x" * 150)
        version = store.append(
            "c", {"messages": [message]}, update={"step": k}, expected_version=version, reason="r"
        )
    return encoded


def test_a_snapshot_encodes_the_items_since_the_last_one_not_the_whole_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's text joins what the last one encoded (and the items since, encoded as
    one run): a long session's snapshot no longer encodes its whole history again."""
    store = _store(tmp_path, ConversationState, snapshot_every=10)
    encoded = _appended_with_encoded_chars(store, 400, monkeypatch)
    history = sorted(store.history("c"), key=lambda h: h.version)
    fulls = [h for h in history if h.kind == "full" and h.version > 1]
    assert len(fulls) >= 3, fulls
    for later in fulls[1:]:
        # Its payload holds every message; what it encoded is the messages since the last
        # snapshot (the deltas' worth: about half the payload under the snapshot policy).
        assert encoded[later.version] < 0.6 * later.size_bytes, (later, encoded[later.version])
    fresh = _store(tmp_path, ConversationState)
    for probe in (fulls[-1].version - 1, fulls[-1].version, fulls[-1].version + 1):
        assert len(fresh.at("c", probe).state.messages) == probe - 1
    assert fresh.load("c").state == store.load("c").state
    store.close()
    fresh.close()


def test_a_joined_snapshot_is_the_text_the_whole_state_encodes_to(tmp_path: Path) -> None:
    """Byte for byte what ``encode_full`` writes, so readers and sizes see no difference;
    after a read from the store (no texts kept) the first snapshot encodes the list whole."""
    store = _store(tmp_path, ConversationState, snapshot_every=5)
    version = store.create("c", ConversationState()).version
    for k in range(1, 120):
        if k == 60:
            store.close()
            store = _store(tmp_path, ConversationState, snapshot_every=5)
        message = Message.user(f"message {k} \u00e9\u4e2d " + "y" * (k % 7) * 20)
        version = store.append(
            "c", {"messages": [message]}, update={"step": k}, expected_version=version, reason="r"
        )
    db = sqlite3.connect(tmp_path / "g.db")
    rows = db.execute(
        "SELECT version, payload FROM keel_state_checkpoints WHERE kind = 'full' AND version > 1"
    ).fetchall()
    db.close()
    assert len(rows) >= 4
    for _, payload in rows:
        assert payload == encode_full(json.loads(payload)["full"])
    store.close()


def test_small_states_still_get_a_snapshot_every_snapshot_every_versions(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, CounterState, snapshot_every=5)
    cp = store.create("s", CounterState())
    for _ in range(20):
        cp = store.update("s", {"counter": 1}, expected_version=cp.version)
    fulls = [h.version for h in store.history("s") if h.kind == "full"]
    assert sorted(fulls) == [1, 6, 11, 16, 21]
    store.close()


def test_a_large_state_changed_by_tiny_deltas_still_gets_snapshots(tmp_path: Path) -> None:
    store = _store(tmp_path, ConversationState, snapshot_every=10)
    messages = [Message.user(f"message {k} " + "x" * 150) for k in range(100)]
    version = store.create("c", ConversationState(messages=messages)).version
    for k in range(1, 201):
        version = store.update("c", {"step": k}, expected_version=version).version
    fulls = [h.version for h in store.history("c") if h.kind == "full"]
    # ~20 kB of state, ~20-byte deltas: charging each row its replay cost bounds the rows a
    # read replays to the snapshot's size over that cost, not 1,000 versions of tiny deltas.
    assert 2 <= len(fulls) <= 5
    assert store.at("c", 150).state.step == 149
    store.close()


class Rows(BaseModel):
    rows: Annotated[list[dict[str, int]], append] = Field(default_factory=list)


def test_items_that_can_change_in_place_are_compared_and_validated_again(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, Rows)
    version = store.create("r", Rows(rows=[{"x": 1}])).version
    state = store.load("r").state
    state.rows[0]["x"] = 2
    version = store.checkpoint("r", state, expected_version=version, reason="r")
    state.rows.append({"y": 1})
    version = store.checkpoint("r", state, expected_version=version, reason="r")
    state.rows[0]["x"] = 3
    version = store.checkpoint("r", state, expected_version=version, reason="r")
    state.rows[0]["x"] = "bad"  # type: ignore[assignment]
    with pytest.raises(StateValidationError, match=r"rows\.0\.x"):
        store.checkpoint("r", state, expected_version=version, reason="r")
    fresh = _store(tmp_path, Rows)
    assert fresh.load("r").state.rows == [{"x": 3}, {"y": 1}]
    assert fresh.at("r", 2).state.rows == [{"x": 2}]
    store.close()
    fresh.close()


def test_a_large_value_inside_the_runtime_is_stored_when_it_changes_not_every_step(
    tmp_path: Path,
) -> None:
    from keel.state import SessionRuntime

    store = _store(tmp_path, AgentState, snapshot_every=1000)
    summary = "what the user asked and what was done " * 500  # ~19 KB
    state = AgentState(runtime=SessionRuntime(summary=summary))
    version = store.create("s", state).version
    for turn in range(1, 41):
        state = state.model_copy(
            update={"runtime": state.runtime.model_copy(update={"turns": turn})}
        )
        version = store.checkpoint("s", state, expected_version=version, reason="turn")
    deltas = [h for h in store.history("s") if h.kind == "delta"]
    assert len(deltas) == 40
    # The summary rides in the first snapshot only: each delta holds the changed counter.
    assert max(h.size_bytes for h in deltas) < 500
    assert (
        StateStore(state_backend_at(f"sqlite:///{tmp_path / 'g.db'}"), AgentState).load("s").state
        == state
    )
    store.close()


def test_a_head_row_read_for_a_base_replaced_meanwhile_is_read_again_in_full(
    tmp_path: Path,
) -> None:
    """The head row alone stands for a state only while it is the base this store holds; one
    that another thread of the store replaced during the read is read again, whole."""
    backend = state_backend_at(f"sqlite:///{tmp_path / 'state.db'}")
    store = StateStore(backend, ConversationState, snapshot_every=50)
    version = store.create("c", ConversationState()).version
    for k in range(3):
        version = store.append(
            "c", {"messages": [Message.user(f"m{k}")]}, expected_version=version, reason="r"
        )
    read_head_chain = backend.read_head_chain
    moved: list[int] = []

    def racing_read(session_id: str, now: float, known_version: int, known_epoch: str) -> Any:
        chain = read_head_chain(session_id, now, known_version, known_epoch)
        if not moved:  # another thread appends between the read and the cache check
            moved.append(
                store.append(
                    "c",
                    {"messages": [Message.user("m3")]},
                    expected_version=known_version,
                    reason="r",
                )
            )
        return chain

    backend.read_head_chain = racing_read  # type: ignore[method-assign]
    got = store.get("c")
    assert got is not None and moved
    assert [m.content for m in got.state.messages] == ["m0", "m1", "m2", "m3"]
    assert got.version == moved[0]


def test_a_reader_another_writer_moved_on_validates_only_the_items_written_since(
    tmp_path: Path,
) -> None:
    """Catching up on a known version (a worker that did not write the head): the rows written
    since are applied to it and only their new items validated, however long the list; a model
    validator that must see the whole state still does."""
    writer, reader = _store(tmp_path, Journal), _store(tmp_path, Journal)
    version = writer.create("j", Journal(entries=[Entry(text=f"e{k}") for k in range(50)])).version
    assert len(reader.load("j").state.entries) == 50
    for k in (50, 51, 52):
        version = writer.update(
            "j", {"entries": [Entry(text=f"e{k}")], "step": k}, expected_version=version
        ).version
    _checked.clear()
    caught_up = reader.load("j")
    assert _checked == ["e50", "e51", "e52"]
    assert caught_up.state == writer.load("j").state and caught_up.version == version
    assert caught_up.state.step == 52
    strict_writer, strict_reader = (
        _store(tmp_path, AtMostThree),
        _store(tmp_path, AtMostThree),
    )
    version = strict_writer.create("s", AtMostThree(messages=[Message.user("a")])).version
    assert len(strict_reader.load("s").state.messages) == 1
    version = strict_writer.append(
        "s", {"messages": [Message.assistant("b")]}, expected_version=version, reason="r"
    )
    assert [m.content for m in strict_reader.load("s").state.messages] == ["a", "b"]
    for store in (writer, reader, strict_writer, strict_reader):
        store.close()


def _entries(name: str, count: int = 3) -> list[Entry]:
    return [Entry(text=f"{name}{k}") for k in range(count)]


def test_a_store_keeps_the_most_recently_used_sessions_and_reads_the_others_whole(
    tmp_path: Path,
) -> None:
    # A service worker meets sessions without end: what it keeps of them is bounded.
    store = _store(tmp_path, Journal, known_sessions=2)
    for name in ("a", "b", "c"):
        store.create(name, Journal(entries=_entries(name)))
    _checked.clear()
    assert [len(store.load(name).state.entries) for name in ("c", "b")] == [3, 3]
    assert _checked == []  # kept: nothing decoded or validated again
    a = store.load("a")  # the least recently used, dropped: read whole
    assert sorted(_checked) == ["a0", "a1", "a2"]
    assert a.state.entries == _entries("a")
    _checked.clear()
    store.load("b")  # used more recently than c, so c went when a came back
    store.load("c")
    assert _checked == ["c0", "c1", "c2"]
    # A dropped session's next write is as safe as any: on the version read, a stale one refused.
    version = store.load("b").version
    store.append("b", {"entries": [Entry(text="b3")]}, expected_version=version, reason="r")
    with pytest.raises(ConflictError):
        store.append("b", {"entries": [Entry(text="bx")]}, expected_version=version, reason="r")
    assert [e.text for e in store.load("b").state.entries] == ["b0", "b1", "b2", "b3"]


def test_a_store_keeps_about_its_byte_bound_and_always_the_newest(tmp_path: Path) -> None:
    store = _store(tmp_path, Journal, known_bytes=1)
    for name in ("a", "b"):
        store.create(name, Journal(entries=_entries(name)))
    _checked.clear()
    store.load("b")
    assert _checked == []  # the newest, kept whatever its size
    store.load("a")
    assert sorted(_checked) == ["a0", "a1", "a2"]
    with pytest.raises(UsageError):
        _store(tmp_path, Journal, known_sessions=0)


def test_a_store_left_to_its_defaults_drops_the_session_unused_longest(tmp_path: Path) -> None:
    # The default bound (1,024 sessions): a worker serving more users than that keeps the
    # recent ones, not every session it ever met.
    store = _store(tmp_path, Journal)
    for k in range(1025):
        store.create(f"s{k}", Journal(entries=[Entry(text=f"s{k}")]))
    _checked.clear()
    store.load("s1024")
    assert _checked == []
    store.load("s0")
    assert _checked == ["s0"]


class Line(BaseModel):
    model_config = ConfigDict(frozen=True)

    text: str


class Log(BaseModel):
    lines: Annotated[list[Line], append] = Field(default_factory=list)


def _long_session(store: StateStore[Any], name: str) -> None:
    """A session whose appends reach snapshots (each snapshot joins its lists' texts)."""
    lines = [Line(text=f"{name}{k}" + "x" * 500) for k in range(20)]
    version = store.create(name, Log(lines=lines)).version
    for k in range(30):
        line = Line(text=f"{name}-{k}" + "y" * 600)
        version = store.append(name, {"lines": [line]}, expected_version=version, reason="r")


def _retained_by_one_and_twenty_sessions(store: StateStore[Any]) -> tuple[int, int]:
    """The bytes still allocated after one long session, then after twenty (a warm-up first)."""
    _long_session(store, "warm")
    tracemalloc.start()
    try:
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        _long_session(store, "s0")
        gc.collect()
        one = tracemalloc.get_traced_memory()[0] - start
        for k in range(1, 20):
            _long_session(store, f"s{k}")
        gc.collect()
        return one, tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()


def test_a_session_the_store_no_longer_keeps_leaves_nothing_of_it_in_memory(
    tmp_path: Path,
) -> None:
    # known_sessions bounds a worker's memory: the text a snapshot joined (its lists' items
    # encoded before) goes with the base that held those lists, not every session's history
    # (each ~55 KB of JSON here) kept until 256 lists were met.
    store = _store(tmp_path, Log, known_sessions=1, snapshot_every=1)
    one, twenty = _retained_by_one_and_twenty_sessions(store)
    assert len(store.load("s19").state.lines) == 50
    assert twenty < one + 20_000, (one, twenty)
    store.close()


def test_a_snapshot_encodes_only_the_items_appended_since_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each snapshot joins the text the last one encoded: over a session's snapshots every
    # item is encoded for them once, not once a snapshot (the text stays with the newest base).
    store = _store(tmp_path, Log, snapshot_every=1)
    encoded: list[int] = []
    real = _codec.encode_json

    def counting(value: Any) -> str:
        if isinstance(value, list):
            encoded.append(len(value))
        return real(value)

    monkeypatch.setattr(_codec, "encode_json", counting)
    version = store.create("s", Log(lines=[Line(text=f"s{k}") for k in range(5)])).version
    for k in range(5, 150):
        line = Line(text=f"s{k}")
        version = store.append("s", {"lines": [line]}, expected_version=version, reason="r")
    assert sum(info.kind == "full" for info in store.history("s")) >= 4
    assert sum(encoded) <= len(store.load("s").state.lines) == 150
    store.close()


def test_a_snapshot_a_reader_overtook_leaves_nothing_of_its_session_in_memory(
    tmp_path: Path,
) -> None:
    # A reader of the store (another thread) reads the snapshot just committed before its
    # writer makes it the known base: the reader's base is kept, and the writer's joined text
    # must not stay behind it, holding a dropped session's history.
    store = _store(tmp_path, Log, known_sessions=1, snapshot_every=1)
    write = store.backend.write

    def write_then_read(session_id: str, row: Any, **options: Any) -> None:
        write(session_id, row, **options)
        if row.kind == "full":
            store.load(session_id)

    store.backend.write = write_then_read  # type: ignore[method-assign]
    one, twenty = _retained_by_one_and_twenty_sessions(store)
    assert [len(store.load(f"s{k}").state.lines) for k in (0, 19)] == [50, 50]
    assert twenty < one + 20_000, (one, twenty)
    store.close()
