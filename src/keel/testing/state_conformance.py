"""The conformance suite every state backend must pass.

A backend's test module subclasses `StateBackendConformance` and supplies only a factory:
a ``state_backend_url`` fixture naming fresh, empty storage that ``Backends.open`` opens
(the URL is what lets the crash tests open the same storage from another process):

```python
class TestSQLiteState(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, tmp_path):
        return f"sqlite:///{tmp_path / 'state.db'}"
```

It covers compare-and-set, reducers, history (read at a version, revert, fork), delta storage,
retention and vacuum, expiry, schema migrations, advisory locks with fencing, the async twins,
and the seeds' scenarios: the e-commerce race, 64 concurrent writers, and SIGKILL at any point.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from keel.errors import (
    ConflictError,
    DatabaseLockedError,
    ExpiredError,
    StateError,
    StateMigrationError,
    StateValidationError,
)
from keel.messages import Message
from keel.state import (
    AgentState,
    Retention,
    SessionRuntime,
    StateBackend,
    StateSchema,
    StateStore,
    append,
    erase_user_sessions,
)
from keel.state._backend import Chain
from keel.state._lease import THIS_PROCESS
from keel.testing._state_models import ConversationState, CounterState
from keel.testing._state_scenarios import StateScenarios
from keel.testing._state_worker import state_backend_at

__all__ = ["StateBackendConformance"]


class _Clock:
    """A settable clock for expiry and retention tests."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class _ProfileV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    tags: Annotated[list[str], append] = Field(default_factory=list)


class _ProfileV2(BaseModel):
    """V1 plus a field with a default: loading V1 data must not fill it in silently."""

    model_config = ConfigDict(extra="forbid")
    name: str
    tags: Annotated[list[str], append] = Field(default_factory=list)
    locale: str = "en"


class _UserErasureConformance:
    """A user's erasure from a state backend (`erase_user_sessions`): part of
    `StateBackendConformance`, its tests kept in a class of their own."""

    def test_erase_user_deletes_their_sessions_whole_and_only_theirs(
        self, backend: StateBackend
    ) -> None:
        store = StateStore(backend, AgentState, snapshot_every=2)
        owners = {
            "acme/s1": ("acme", "ada"),
            "acme/s2": ("acme", "ada"),
            "acme/s3": ("acme", "bob"),
            "ACME/s4": ("ACME", "ada"),  # another tenant, spelled alike but for case
            "acme%2Fx/s5": ("acme/x", "ada"),  # another tenant, whose key starts "acme"
            "acme_/s6": ("acme_", "ada"),  # a LIKE wildcard in the tenant
        }
        for key, (tenant, user) in owners.items():
            runtime = SessionRuntime(tenant_id=tenant, user_id=user)
            checkpoint = store.create(key, AgentState(runtime=runtime))
            for n in range(3):
                checkpoint = store.update(
                    key, {"data": {"n": n}}, expected_version=checkpoint.version
                )
        now = time.time()
        assert backend.acquire_lock("session:acme/s1", "worker-1", 60, now)
        assert backend.sessions_under("acme/") == ["acme/s1", "acme/s2", "acme/s3"]
        erased = erase_user_sessions(backend, "acme", "ada")
        assert sorted(erased.sessions) == ["acme/s1", "acme/s2"]
        assert erased.counts == {"sessions": 2, "checkpoints": 8, "leases": 1}
        assert store.get("acme/s1") is None and store.get("acme/s2") is None
        assert sorted(backend.sessions()) == sorted(set(owners) - {"acme/s1", "acme/s2"})
        for kept in set(owners) - {"acme/s1", "acme/s2"}:
            assert len(store.history(kept)) == 4
        assert backend.acquire_lock("session:acme/s1", "worker-2", 60, now), "the lease stayed"
        assert erase_user_sessions(backend, "acme", "ada").sessions == ()
        assert backend.erase_sessions(["acme/s1"]) == {"sessions": 0, "checkpoints": 0, "leases": 1}

    def test_a_deleted_session_leaves_no_lease_behind(self, backend: StateBackend) -> None:
        # A lease given back may stay as a row that holds nothing (SQL expires it in place):
        # the session's deletion takes it, so no key naming the session outlives it (an
        # erasure later finds no session there, and erases nothing of it).
        store = StateStore(backend, AgentState)
        runtime = SessionRuntime(tenant_id="acme", user_id="ada")
        store.create("acme/gone", AgentState(runtime=runtime))
        with store.lock("acme/gone"):
            pass
        assert store.delete("acme/gone")
        assert erase_user_sessions(backend, "acme", "ada").sessions == ()
        assert backend.erase_sessions(["acme/gone"]) == {
            "sessions": 0,
            "checkpoints": 0,
            "leases": 0,
        }

    def test_an_erasure_counts_the_leases_held_not_those_given_back(
        self, backend: StateBackend
    ) -> None:
        store = StateStore(backend, AgentState)
        runtime = SessionRuntime(tenant_id="acme", user_id="ada")
        store.create("acme/idle", AgentState(runtime=runtime))
        store.create("acme/busy", AgentState(runtime=runtime))
        with store.lock("acme/idle"):
            pass
        assert backend.acquire_lock("session:acme/busy", "worker-1", 60, time.time())
        erased = erase_user_sessions(backend, "acme", "ada")
        assert erased.counts == {"sessions": 2, "checkpoints": 2, "leases": 1}
        assert backend.erase_sessions(["acme/idle", "acme/busy"]) == {
            "sessions": 0,
            "checkpoints": 0,
            "leases": 0,
        }


class StateBackendConformance(StateScenarios, _UserErasureConformance):
    """Backend-independent tests; subclasses override the ``state_backend_url`` fixture."""

    @pytest.fixture
    def state_backend_url(self) -> str:
        raise NotImplementedError("override the state_backend_url fixture with a fresh storage URL")

    @pytest.fixture
    def backend(self, state_backend_url: str) -> Iterator[StateBackend]:
        opened = state_backend_at(state_backend_url)
        yield opened
        opened.close()

    @pytest.fixture
    def store(self, backend: StateBackend) -> StateStore[CounterState]:
        return StateStore(backend, CounterState, snapshot_every=5)

    # --- basics -------------------------------------------------------------------------------

    def test_create_get_and_missing(self, store: StateStore[CounterState]) -> None:
        assert store.get("nobody") is None
        with pytest.raises(StateError):
            store.load("nobody")
        created = store.create("s1", CounterState(note="hello"))
        assert created.version == 1 and created.info.reason == "created"
        loaded = store.load("s1")
        assert loaded.state == CounterState(note="hello") and loaded.version == 1
        assert "s1" in store.sessions()
        with pytest.raises(ConflictError) as caught:
            store.create("s1", CounterState())
        assert caught.value.expected is None and caught.value.actual == 1

    def test_compare_and_set_rejects_stale_writer_and_writes_nothing(
        self, store: StateStore[CounterState], state_backend_url: str
    ) -> None:
        first = store.create("s", CounterState())
        other_backend = state_backend_at(state_backend_url)
        other = StateStore(other_backend, CounterState)
        try:
            theirs = other.load("s")
            store.update("s", {"counter": 1}, expected_version=first.version)
            with pytest.raises(ConflictError) as caught:
                other.update("s", {"counter": 10, "note": "stale"}, expected_version=theirs.version)
            assert (caught.value.expected, caught.value.actual) == (1, 2)
            with pytest.raises(ConflictError):
                other.checkpoint("s", CounterState(counter=99), expected_version=1, reason="x")
            fresh = other.load("s")
            assert fresh.version == 2 and fresh.state.counter == 1 and fresh.state.note == ""
            assert [info.version for info in other.history("s")] == [2, 1]
        finally:
            other_backend.close()

    # --- appends -------------------------------------------------------------------------

    def test_append_commits_what_a_checkpoint_of_the_whole_state_would(
        self, backend: StateBackend
    ) -> None:
        """Appends stored as deltas and snapshots read back, in this store and a fresh one, as
        the same states written whole, version by version, on every backend."""
        store = StateStore(backend, ConversationState, snapshot_every=3)
        whole = store.create("whole", ConversationState())
        store.create("appended", ConversationState())
        state = whole.state
        for step in range(1, 25):
            new = [Message.user(f"question {step}"), Message.assistant(f"answer {step} " * step)]
            state = ConversationState(messages=[*state.messages, *new], step=step)
            store.checkpoint("whole", state, expected_version=step, reason="step")
            version = store.append(
                "appended",
                {"messages": new},
                update={"step": step},
                expected_version=step,
                reason="step",
            )
            assert version == step + 1
            assert store.load("appended").state == state
        chain = backend.read_chain("appended", None, time.time())
        assert chain is not None
        # Appends wrote snapshots as well as deltas: the chain starts at a later full one.
        assert chain.rows[0].kind == "full" and chain.rows[0].version > 1
        fresh = StateStore(backend, ConversationState)
        for version in (1, 2, 9, 17, 25):
            assert fresh.at("appended", version).state == fresh.at("whole", version).state
        assert fresh.load("appended").state == state

    def test_an_append_on_a_stale_version_is_rejected_and_changes_nothing(
        self, store: StateStore[CounterState], state_backend_url: str
    ) -> None:
        store.create("s", CounterState(items=["a"]))
        other_backend = state_backend_at(state_backend_url)
        other = StateStore(other_backend, CounterState)
        try:
            other.append("s", {"items": ["theirs"]}, expected_version=1, reason="won")
            with pytest.raises(ConflictError) as caught:
                store.append("s", {"items": ["stale"]}, expected_version=1, reason="lost")
            assert (caught.value.expected, caught.value.actual) == (1, 2)
            assert store.load("s").state.items == ["a", "theirs"]
            assert other.load("s").state.items == ["a", "theirs"]
            store.append("s", {"items": ["next"]}, expected_version=2, reason="after")
            assert StateStore(other_backend, CounterState).load("s").state.items == [
                "a",
                "theirs",
                "next",
            ]
        finally:
            other_backend.close()

    def test_an_append_leaves_states_read_before_it_as_they_were(
        self, store: StateStore[CounterState]
    ) -> None:
        store.create("s", CounterState(items=["a"]))
        store.append("s", {"items": ["b"]}, expected_version=1, reason="b")
        read = store.load("s")
        store.append("s", {"items": ["c"]}, update={"note": "n"}, expected_version=2, reason="c")
        assert read.state.items == ["a", "b"] and read.state.note == ""
        read.state.items.append("mine")
        assert store.load("s").state == CounterState(items=["a", "b", "c"], note="n")

    def test_an_invalid_append_is_rejected_with_the_item_s_real_index(
        self, backend: StateBackend
    ) -> None:
        store = StateStore(backend, ConversationState)
        store.create("s", ConversationState(messages=[Message.user("hi")] * 3))
        with pytest.raises(StateValidationError) as caught:
            store.append(
                "s",
                {"messages": [Message.user("ok"), {"role": "nobody", "content": "x"}]},
                expected_version=1,
                reason="bad",
            )
        assert "messages.4" in str(caught.value)
        with pytest.raises(StateValidationError):
            store.append("s", {}, update={"step": -1}, expected_version=1, reason="bad")
        assert store.load("s").version == 1
        assert (
            StateStore(backend, ConversationState).load("s").state.messages
            == [Message.user("hi")] * 3
        )

    async def test_async_appends_match_the_sync_ones(self, backend: StateBackend) -> None:
        store = StateStore(backend, CounterState, snapshot_every=2)
        version = (await store.acreate("s", CounterState())).version
        for n in range(10):
            version = await store.aappend(
                "s",
                {"items": [f"i{n}"]},
                update={"counter": n},
                expected_version=version,
                reason="a",
            )
        assert version == 11
        expected = CounterState(counter=9, items=[f"i{n}" for n in range(10)])
        assert (await store.aload("s")).state == expected
        fresh = StateStore(backend, CounterState)
        assert (await fresh.aload("s")).state == expected
        await store.aclose()

    def test_updates_go_through_reducers_and_history_records_them(
        self, store: StateStore[CounterState]
    ) -> None:
        cp = store.create("s", CounterState())
        cp = store.update(
            "s", {"counter": 2, "items": ["a"]}, expected_version=cp.version, reason="r1", step=1
        )
        cp = store.update(
            "s",
            {"counter": 3, "items": ["b", "c"], "note": "n"},
            expected_version=cp.version,
            reason="before_model_call",
            step=2,
        )
        assert cp.state == CounterState(counter=5, items=["a", "b", "c"], note="n")
        history = store.history("s")
        assert [(h.version, h.reason, h.step) for h in history] == [
            (3, "before_model_call", 2),
            (2, "r1", 1),
            (1, "created", 0),
        ]
        assert history[0].created_at >= history[-1].created_at
        assert store.history("s", limit=1)[0].version == 3
        assert store.at("s", 2).state.items == ["a"]
        with pytest.raises(StateError):
            store.at("s", 9)

    def test_invalid_update_is_rejected_and_nothing_written(
        self, store: StateStore[CounterState]
    ) -> None:
        cp = store.create("s", CounterState(counter=1))
        with pytest.raises(StateValidationError):
            store.update("s", {"counter": -5}, expected_version=cp.version)
        with pytest.raises(StateValidationError):
            store.update("s", {"no_such_field": 1}, expected_version=cp.version)
        with pytest.raises(StateValidationError):
            store.checkpoint("s", {"counter": "many"}, expected_version=cp.version, reason="x")
        assert store.load("s").version == 1

    def test_storage_grows_with_changes_not_with_state(self, backend: StateBackend) -> None:
        store = StateStore(backend, ConversationState, snapshot_every=50)
        cp = store.create("c", ConversationState())
        for k in range(1, 121):
            cp = store.update(
                "c",
                {"messages": [Message.user(f"question number {k} " + "x" * 80)], "step": k},
                expected_version=cp.version,
                reason="before_model_call",
                step=k,
            )
        history = store.history("c")
        deltas = [h for h in history if h.kind == "delta"]
        fulls = [h for h in history if h.kind == "full"]
        assert len(fulls) == 3 and len(deltas) == 118  # v1, v51, v101
        assert max(h.size_bytes for h in deltas) < 400  # one message each, not the whole list
        total = sum(h.size_bytes for h in history)
        full_copies = sum(len(cp.state.messages[:k]) for k in range(1, 121)) * 150
        assert total < full_copies / 10
        for version in (1, 2, 50, 51, 52, 100, 101, 121):
            state = store.at("c", version).state
            assert len(state.messages) == version - 1
            if version > 1:
                assert state.messages[-1].content.startswith(f"question number {version - 1} ")
        reopened = StateStore(_reopened(backend), ConversationState)
        try:
            assert reopened.load("c").state == cp.state
        finally:
            reopened.close()

    def test_add_messages_replaces_by_id_and_is_stored_correctly(
        self, backend: StateBackend
    ) -> None:
        store = StateStore(backend, ConversationState, snapshot_every=100)
        cp = store.create("m", ConversationState())
        draft = Message.assistant("draft", metadata={"id": "r1"})
        cp = store.update("m", {"messages": [Message.user("q"), draft]}, expected_version=1)
        final = Message.assistant("final", metadata={"id": "r1"})
        cp = store.update("m", {"messages": final}, expected_version=cp.version)
        assert [m.content for m in cp.state.messages] == ["q", "final"]
        assert [m.content for m in store.load("m").state.messages] == ["q", "final"]
        assert [m.content for m in store.at("m", 2).state.messages] == ["q", "draft"]

    # --- history: revert and fork -------------------------------------------------------------

    def test_revert_to_last_good_and_to_a_version(self, store: StateStore[CounterState]) -> None:
        cp = store.create("s", CounterState())
        with pytest.raises(StateError):
            store.revert("s", expected_version=cp.version)
        cp = store.update("s", {"counter": 1}, expected_version=cp.version, good=True)
        good_version = cp.version
        cp = store.update("s", {"counter": 1, "items": ["bad"]}, expected_version=cp.version)
        cp = store.update("s", {"counter": 1}, expected_version=cp.version)
        store.mark("s", cp.version, good=False)
        assert store.last_good("s") is not None
        assert store.last_good("s").version == good_version  # type: ignore[union-attr]
        with pytest.raises(ConflictError):
            store.revert("s", expected_version=cp.version - 1)
        reverted = store.revert("s", expected_version=cp.version)
        assert reverted.version == cp.version + 1
        assert reverted.state == CounterState(counter=1)
        assert reverted.info.reason == f"revert to v{good_version}"
        assert store.at("s", cp.version).state.items == ["bad"]  # history is append-only
        again = store.revert("s", expected_version=reverted.version, to_version=1)
        assert again.state == CounterState()
        with pytest.raises(StateError):
            store.mark("s", 999, good=True)
        marks = {info.version: info.good for info in store.history("s")}
        assert marks[good_version] is True and marks[cp.version] is False

    def test_a_session_created_good_is_a_revert_target_at_once(
        self, store: StateStore[CounterState]
    ) -> None:
        created = store.create("s", CounterState(counter=1), good=True)
        assert created.info.good is True
        assert store.last_good("s") is not None
        assert store.last_good("s").version == 1  # type: ignore[union-attr]
        cp = store.update("s", {"counter": 5}, expected_version=1)
        assert store.revert("s", expected_version=cp.version).state == CounterState(counter=1)
        plain = store.create("plain", CounterState())
        assert plain.info.good is None and store.last_good("plain") is None

    def test_fork_from_a_checkpoint(self, store: StateStore[CounterState]) -> None:
        cp = store.create("main", CounterState())
        for _ in range(3):
            cp = store.update("main", {"counter": 1}, expected_version=cp.version)
        fork = store.fork("main", "branch", version=2)
        assert fork.version == 1 and fork.state.counter == 1
        assert fork.info.forked_from == "main@2" and fork.info.reason == "fork"
        store.update("branch", {"counter": 100}, expected_version=1)
        assert store.load("main").state.counter == 3
        assert store.load("branch").state.counter == 101
        with pytest.raises(ConflictError):
            store.fork("main", "branch")

    def test_a_blind_write_is_a_conflict_of_the_compare_and_set_itself(
        self, store: StateStore[CounterState], backend: StateBackend
    ) -> None:
        # A writer on a stale version whose new row collides with no stored version (a blind
        # write): only the compare-and-set can refuse it, and it answers ConflictError.
        store.create("s", CounterState(counter=1))
        before = store.update("s", {"counter": 2}, expected_version=1).state
        now = time.time()
        chain = backend.read_chain("s", None, now)
        assert chain is not None and chain.head.version == 2
        blind = dataclasses.replace(chain.rows[-1], version=9, reason="blind")
        for expected, epoch in ((1, chain.head.epoch), (2, "another-incarnation")):
            with pytest.raises(ConflictError) as caught:
                backend.write(
                    "s", blind, expected_version=expected, expected_epoch=epoch,
                    new_epoch=None, ttl=None, now=now,
                )  # fmt: skip
            assert caught.value.actual == 2
        assert [info.version for info in store.history("s")] == [2, 1]
        assert store.load("s").state == before

    def test_delete_and_recreate_fences_old_writers(
        self, store: StateStore[CounterState], state_backend_url: str
    ) -> None:
        store.create("s", CounterState(counter=1))
        other_backend = state_backend_at(state_backend_url)
        other = StateStore(other_backend, CounterState)
        try:
            stale = other.load("s")
            assert store.delete("s") is True and store.get("s") is None
            assert store.delete("s") is False
            store.create("s", CounterState(counter=50))
            with pytest.raises(ConflictError):
                other.update("s", {"counter": 1}, expected_version=stale.version)
            assert store.load("s").state.counter == 50
        finally:
            other_backend.close()

    # --- retention and expiry -----------------------------------------------------------------

    def test_retention_keeps_last_n_and_the_good_one(self, backend: StateBackend) -> None:
        store = StateStore(
            backend, CounterState, retention=Retention(keep_last=4), snapshot_every=100
        )
        cp = store.create("s", CounterState())
        for k in range(1, 13):
            cp = store.update(
                "s",
                {"counter": 1, "items": [f"i{k}"]},
                expected_version=cp.version,
                good=True if k == 3 else None,
            )
        report = store.vacuum()
        kept = sorted(info.version for info in store.history("s"))
        assert kept == [4, 10, 11, 12, 13]
        assert report.checkpoints_deleted == 8 and report.checkpoints_rebased >= 2
        assert store.at("s", 10).state.items == [f"i{k}" for k in range(1, 10)]
        assert store.at("s", 4).state.counter == 3
        assert store.load("s").state == cp.state
        with pytest.raises(StateError):
            store.at("s", 5)
        cp = store.update("s", {"counter": 1}, expected_version=cp.version)
        assert store.load("s").state.counter == 13
        assert store.revert("s", expected_version=cp.version).state.counter == 3

    def test_retention_by_age(self, backend: StateBackend) -> None:
        clock = _Clock()
        store = StateStore(backend, CounterState, retention=Retention(max_age_s=60), clock=clock)
        cp = store.create("s", CounterState())
        for _ in range(3):
            cp = store.update("s", {"counter": 1}, expected_version=cp.version)
        clock.now += 120
        cp = store.update("s", {"counter": 1}, expected_version=cp.version)
        store.vacuum()
        assert [info.version for info in store.history("s")] == [5]
        assert store.load("s").state.counter == 4

    def test_expired_sessions_read_as_absent_and_say_so(self, backend: StateBackend) -> None:
        clock = _Clock()
        store = StateStore(backend, CounterState, clock=clock)
        cp = store.create("s", CounterState(), ttl=10)
        store.create("forever", CounterState())
        clock.now += 8
        cp = store.update("s", {"counter": 1}, expected_version=cp.version)  # slides the expiry
        clock.now += 8
        assert store.load("s").state.counter == 1
        clock.now += 3
        with pytest.raises(ExpiredError):
            store.get("s")
        with pytest.raises(ConflictError):
            store.update("s", {"counter": 1}, expected_version=cp.version)
        report = store.vacuum()
        assert report.expired_sessions == ["s"]
        assert store.get("s") is None and store.get("forever") is not None
        recreated = store.create("s", CounterState(counter=7), ttl=10)
        assert recreated.version == 1 and store.load("s").state.counter == 7

    def test_create_replaces_an_expired_session(self, backend: StateBackend) -> None:
        clock = _Clock()
        store = StateStore(backend, CounterState, clock=clock, default_ttl=5)
        store.create("s", CounterState(counter=1))
        clock.now += 6
        fresh = store.create("s", CounterState(counter=2))
        assert fresh.version == 1 and store.load("s").state.counter == 2
        assert [info.version for info in store.history("s")] == [1]

    # --- schema versions ----------------------------------------------------------------------

    def test_schema_change_without_migration_fails_loudly(self, backend: StateBackend) -> None:
        old = StateStore(backend, StateSchema(_ProfileV1, name="profile"))
        cp = old.create("p", _ProfileV1(name="ada"))
        old.update("p", {"tags": ["x"]}, expected_version=cp.version)
        same_version = StateStore(backend, StateSchema(_ProfileV2, name="profile"))
        with pytest.raises(StateMigrationError, match="locale"):
            same_version.get("p")
        bumped = StateStore(backend, StateSchema(_ProfileV2, name="profile", version=2))
        with pytest.raises(StateMigrationError, match="no migration"):
            bumped.get("p")
        other_type = StateStore(backend, StateSchema(_ProfileV1, name="account"))
        with pytest.raises(StateMigrationError):
            other_type.get("p")

    def test_registered_migration_runs_and_new_writes_use_it(self, backend: StateBackend) -> None:
        old = StateStore(backend, StateSchema(_ProfileV1, name="profile"))
        cp = old.create("p", _ProfileV1(name="ada"))
        old.update("p", {"tags": ["x"]}, expected_version=cp.version)
        schema = StateSchema(_ProfileV2, name="profile", version=2)

        @schema.migration(1)
        def add_locale(data: dict[str, Any]) -> dict[str, Any]:
            return {**data, "locale": "fr"}

        new = StateStore(backend, schema)
        loaded = new.load("p")
        assert loaded.state == _ProfileV2(name="ada", tags=["x"], locale="fr")
        cp2 = new.update("p", {"tags": ["y"]}, expected_version=loaded.version)
        info = new.history("p", limit=1)[0]
        assert info.schema_version == 2 and info.kind == "full"
        assert new.load("p").state.tags == ["x", "y"] and cp2.version == 3
        assert new.at("p", 1).state.locale == "fr"
        with pytest.raises(StateMigrationError, match="newer"):
            old.get("p")

    def test_a_known_head_is_read_again_once_another_writer_moved_it(
        self, store: StateStore[CounterState], state_backend_url: str
    ) -> None:
        cp = store.create("c", CounterState())
        assert store.load("c").state.counter == 0  # this store now knows the head
        other_backend = state_backend_at(state_backend_url)
        other = StateStore(other_backend, CounterState)
        try:
            moved = other.update("c", {"counter": 3}, expected_version=cp.version)
            got = store.load("c")
            assert got.version == moved.version and got.state.counter == 3
            other.mark("c", moved.version, good=True)
            assert store.load("c").info.good is True  # metadata is fresh, not cached
            # Each read is the caller's own copy: changing it in place changes nothing stored.
            mine = store.load("c")
            mine.state.items.append("local only")
            again = store.load("c")
            assert again.state.items == [] and again.version == moved.version
            store.update("c", {"counter": 1}, expected_version=again.version)
            assert other.load("c").state == CounterState(counter=4)
        finally:
            other_backend.close()

    async def test_a_read_of_the_head_a_reader_holds_costs_one_row_however_long_the_chain(
        self, backend: StateBackend
    ) -> None:
        store = StateStore(backend, ConversationState, snapshot_every=50)
        version = store.create("c", ConversationState()).version
        for k in range(1, 41):
            version = store.append(
                "c",
                {"messages": [Message.user(f"turn {k}")]},
                expected_version=version,
                reason="before_model_call",
            )
        now = time.time()
        whole = backend.read_chain("c", None, now)
        assert whole is not None and len(whole.rows) == 41  # v1 (full), then 40 deltas
        head = whole.head
        for read in (
            backend.read_head_chain("c", now, head.version, head.epoch),
            await backend.aread_head_chain("c", now, head.version, head.epoch),
        ):
            assert read is not None and read.head == head
            assert read.rows == [whole.rows[-1]]  # a reader's per-turn read: the head row alone
        # A reader holding an older version of this incarnation gets the rows after it (it
        # catches up on them); one holding another incarnation's version, the whole chain.
        for read in (
            backend.read_head_chain("c", now, head.version - 3, head.epoch),
            await backend.aread_head_chain("c", now, head.version - 3, head.epoch),
        ):
            assert read is not None and read.head == head and read.rows == whole.rows[-3:]
        for read in (
            backend.read_head_chain("c", now, head.version, "another"),
            await backend.aread_head_chain("c", now, head.version, "another"),
        ):
            assert read is not None and read.rows == whole.rows
        # Through stores: the one holding the head reads it cheaply, a fresh one in full; both
        # read the same state, and a writer elsewhere is seen.
        expected = [f"turn {k}" for k in range(1, 41)]
        mine = await store.aget("c")
        assert mine is not None and [m.content for m in mine.state.messages] == expected
        fresh = StateStore(_reopened(backend), ConversationState)
        try:
            theirs = await fresh.aget("c")
            assert theirs is not None and theirs.state == mine.state
            moved = fresh.append(
                "c",
                {"messages": [Message.user("elsewhere")]},
                expected_version=version,
                reason="before_model_call",
            )
            for seen in (await store.aget("c"), store.get("c")):
                assert seen is not None and seen.version == moved
                assert [m.content for m in seen.state.messages] == [*expected, "elsewhere"]
        finally:
            await fresh.aclose()
            await store.aclose()

    async def test_a_reader_another_writer_moved_on_reads_only_the_rows_written_since(
        self, backend: StateBackend
    ) -> None:
        """A process holding a session's version v loads it, once another process has written k
        turns, from the k rows after v: the cost of a decision by a worker that did not write
        the head stays flat however long the session is (counted in rows, not timed)."""
        writer = StateStore(backend, ConversationState, snapshot_every=1000)
        version = writer.create("c", ConversationState()).version
        for k in range(60):
            version = writer.append(
                "c", {"messages": [Message.user(f"m{k}")]}, expected_version=version, reason="x"
            )
        reader_backend = _reopened(backend)
        rows_read = _count_rows_read(reader_backend)
        reader = StateStore(reader_backend, ConversationState)
        try:
            assert reader.load("c").version == 61 and rows_read == [61]  # the whole chain
            for turn, k in enumerate((3, 1, 7, 2)):
                for n in range(k):
                    version = writer.append(
                        "c",
                        {"messages": [Message.assistant(f"t{turn}.{n}")]},
                        expected_version=version,
                        reason="x",
                        update={"step": turn + 1},
                    )
                rows_read.clear()
                got = reader.load("c") if turn % 2 else await reader.aload("c")
                assert rows_read == [k]
                theirs = writer.get("c")
                assert theirs is not None
                assert got.version == version and got.state == theirs.state
                assert got.info == theirs.info
            # What the reader caught up on is a base it writes on, as any other.
            mine = reader.append(
                "c", {"messages": [Message.user("mine")]}, expected_version=version, reason="x"
            )
            fresh = StateStore(_reopened(backend), ConversationState)
            try:
                assert fresh.load("c").state == reader.load("c").state
                assert fresh.load("c").version == mine
            finally:
                fresh.close()
        finally:
            await reader.aclose()

    def test_a_catch_up_reads_the_whole_chain_when_the_rows_after_it_are_not_all_there(
        self, backend: StateBackend
    ) -> None:
        """A snapshot among the new rows, a retention that dropped some of them, a schema the
        reader does not share, a session deleted and created again: the state read is always
        the one a fresh reader reads."""
        writer = StateStore(backend, CounterState, snapshot_every=2)
        reader = StateStore(_reopened(backend), CounterState, snapshot_every=2)
        fresh = StateStore(_reopened(backend), CounterState)
        try:
            version = writer.create("c", CounterState()).version
            assert reader.load("c").version == version
            for step in range(6):
                update = {"counter": 1, "items": [f"i{step}"], "note": f"n{step}"}
                version = writer.update("c", update, expected_version=version).version
            assert "full" in [info.kind for info in writer.history("c", limit=5)]
            assert reader.load("c").state == fresh.load("c").state == writer.load("c").state
            held = version
            for step in range(4):
                version = writer.update(
                    "c", {"items": [f"j{step}"]}, expected_version=version
                ).version
            writer.drop_versions("c", [held + 2])
            assert reader.load("c").state == fresh.load("c").state
            assert reader.load("c").state.items[-1] == "j3"
            writer.delete("c")
            writer.create("c", CounterState(note="again"))
            assert reader.load("c").state == CounterState(note="again")
        finally:
            reader.close()
            fresh.close()

    # --- locks --------------------------------------------------------------------------------

    async def test_a_lease_held_elsewhere_refuses_the_block_after_its_wait(
        self, store: StateStore[CounterState]
    ) -> None:
        holder = store.session_lock("busy", ttl=30)
        assert holder.acquire()
        refused = pytest.raises(DatabaseLockedError, match="'busy' is locked")
        with refused, store.lock("busy", ttl=5, wait=0.05):
            pytest.fail("the block ran without the lease")
        with pytest.raises(DatabaseLockedError, match="'busy' is locked"):
            async with store.alock("busy", ttl=5, wait=0.05):
                pytest.fail("the block ran without the lease")
        assert holder.release()
        with store.lock("busy", ttl=5, wait=0) as lease:
            held_in_block = lease.held
        assert held_in_block
        assert not lease.held  # released at the end of the block
        assert store.session_lock("busy", ttl=5).acquire()
        await store.aclose()

    def test_lock_is_advisory_and_the_version_check_fences(
        self, store: StateStore[CounterState], state_backend_url: str
    ) -> None:
        cp = store.create("s", CounterState())
        other_backend = state_backend_at(state_backend_url)
        other = StateStore(other_backend, CounterState)
        try:
            slow = store.session_lock("s", ttl=1.0)
            assert slow.acquire()
            read = store.load("s")
            assert not other.session_lock("s", ttl=5).acquire(wait=0.05)
            time.sleep(1.2)  # the slow writer stalls; its lease expires
            with other.lock("s", ttl=5, wait=2):
                other.update("s", {"counter": 5}, expected_version=cp.version)
            with pytest.raises(ConflictError):  # fencing: its lease is gone, its version stale
                store.update("s", {"counter": 1}, expected_version=read.version)
            assert slow.release() is False
            assert store.load("s").state.counter == 5
            with store.lock("s", ttl=5, wait=1) as lease:
                assert lease.held
            assert other.session_lock("s", ttl=5).acquire()
        finally:
            other_backend.close()

    async def test_a_lease_of_a_dead_process_on_this_machine_is_taken_over_at_once(
        self, store: StateStore[CounterState]
    ) -> None:
        host, namespace, _ = THIS_PROCESS.split(":")
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        now = time.time()
        dead_owner = f"{host}:{namespace}:{dead.pid}:0123"
        assert store.backend.acquire_lock("session:d", dead_owner, 60, now)
        assert store.backend.lock_holder("session:d", now) == dead_owner
        with store.lock("d", ttl=5, wait=0) as lease:  # no wait for the 60 s to pass
            assert lease.held
        assert await store.session_lock("d", ttl=5).aacquire(wait=0)
        # A holder on another machine, or one alive here, is never presumed dead.
        elsewhere = f"another-host:{namespace}:{dead.pid}:0123"
        assert store.backend.acquire_lock("session:e", elsewhere, 60, now)
        assert not store.session_lock("e", ttl=5).acquire(wait=0)
        alive = f"{host}:{namespace}:{os.getppid()}:0123"
        assert store.backend.acquire_lock("session:f", alive, 60, now)
        assert not await store.session_lock("f", ttl=5).aacquire(wait=0)
        await store.aclose()

    # --- async twins --------------------------------------------------------------------------

    async def test_async_twins(self, store: StateStore[CounterState]) -> None:
        cp = await store.acreate("a", CounterState())
        cp = await store.aupdate("a", {"counter": 2}, expected_version=cp.version)
        version = await store.acheckpoint(
            "a", CounterState(counter=3), expected_version=cp.version, reason="before_model_call"
        )
        got = await store.aget("a")
        assert got is not None and got.version == version == 3 and got.state.counter == 3
        done = await store.atransact("a", lambda s: {"counter": 1})
        assert done.state.counter == 4
        assert [h.version for h in await store.ahistory("a")] == [4, 3, 2, 1]
        assert (await store.aat("a", 2)).state.counter == 2
        await store.amark("a", 2, good=True)
        assert (await store.arevert("a", expected_version=4)).state.counter == 2
        born_good = await store.acreate("g", CounterState(), good=True)
        assert born_good.info.good is True
        assert (await store.alast_good("g")) is not None
        assert (await store.afork("a", "b")).state.counter == 2
        assert await store.adelete("b") is True
        assert await store.adelete("b") is False
        assert (await store.avacuum()).expired_sessions == []
        with pytest.raises(ConflictError):
            await store.aupdate("a", {"counter": 1}, expected_version=1)
        with pytest.raises(ConflictError):
            await store.acreate("a", CounterState())
        async with store.alock("a", ttl=5, wait=1) as lease:
            assert lease.held
            assert not await store.session_lock("a", ttl=5).aacquire(wait=0.05)
        assert await store.session_lock("a", ttl=5).aacquire()
        await store.aclose()

    async def test_async_concurrent_writers_lose_nothing(self, backend: StateBackend) -> None:
        store = StateStore(backend, CounterState)
        await store.acreate("a", CounterState())

        async def writer(index: int) -> None:
            def bump(_state: CounterState) -> dict[str, Any]:
                return {"counter": 1, "items": [f"t{index}"]}

            await store.atransact("a", bump, max_attempts=10_000)

        await asyncio.gather(*(writer(i) for i in range(24)))
        final = await store.aload("a")
        assert final.state.counter == 24 and final.version == 25
        assert sorted(final.state.items) == sorted(f"t{i}" for i in range(24))
        await store.aclose()


def _count_rows_read(backend: StateBackend) -> list[int]:
    """The rows each chain read of ``backend`` returns from here on, counted as it returns
    them (the backend's own methods wrapped on this instance)."""
    counted: list[int] = []

    def count(chain: Chain | None) -> Chain | None:
        counted.append(0 if chain is None else len(chain.rows))
        return chain

    for name in ("read_chain", "read_head_chain"):
        sync, async_ = getattr(backend, name), getattr(backend, f"a{name}")

        def counting(*args: Any, _sync: Any = sync, **kwargs: Any) -> Chain | None:
            return count(_sync(*args, **kwargs))

        async def acounting(*args: Any, _async: Any = async_, **kwargs: Any) -> Chain | None:
            return count(await _async(*args, **kwargs))

        setattr(backend, name, counting)
        setattr(backend, f"a{name}", acounting)
    return counted


def _reopened(backend: StateBackend) -> StateBackend:
    """A second, independent connection to the storage ``backend`` uses."""
    url = getattr(backend, "url", None)
    database = getattr(backend, "db", None)
    if url is None and database is not None:
        url = getattr(database, "url", None)
        if url is None:
            url = f"sqlite:///{Path(database.path)}"
    if url is None:
        raise NotImplementedError(f"cannot reopen {backend!r}")
    return state_backend_at(str(url))
