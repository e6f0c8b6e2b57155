"""The conformance suite every [`ApprovalStore`][] backend must pass.

A backend's test module subclasses `ApprovalStoreConformance` and supplies a
``approvals_database_url`` fixture naming a fresh, empty database that [`Backends.open`][] opens
(the store is ``Backends.approvals``; the URL lets each thread of the concurrency test open the
database on its own, as another process would):

```python
class TestSQLiteApprovals(ApprovalStoreConformance):
    @pytest.fixture
    def approvals_database_url(self, tmp_path):
        return f"sqlite:///{tmp_path / 'keel.db'}"
```

It covers the contract (round trip, the tool's arguments schema and the decision's channel
included; idempotent adds; oldest-first listing with its filters), the compare-and-set
decision (a repeat and a different second decision leave the first standing; two threads
forced to decide at once by a barrier: exactly one settles), tenant
scoping of every method (the other tenant holds a request with the same id), expiry (a request
past its expiry reads, lists and decides as expired even before a sweep), cancellation, what is
left to carry out (decided and not yet marked carried out, paged oldest first) and its
marking, and durability across a reopen.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus, ApprovalStore
from keel.errors import UsageError
from keel.settings import load_settings
from keel.stores import Backends

__all__ = ["REFUND_SCHEMA", "ApprovalStoreConformance", "request"]

TENANT = "acme"
OTHER_TENANT = "evil-corp"
NOW = 1_800_000_000.0
REFUND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"order": {"type": "string"}, "amount": {"type": "integer"}},
    "required": ["order", "amount"],
    "additionalProperties": False,
}
"""The arguments schema of the refund tool `request` asks about."""


def request(request_id: str = "ap-1", **fields: Any) -> ApprovalRequest:
    """A pending operator approval of a refund in ``TENANT`` (``fields`` override)."""
    values: dict[str, Any] = {
        "id": request_id,
        "tenant_id": TENANT,
        "user_id": "alice",
        "session_id": "s1",
        "turn_id": "t1",
        "kind": "operator",
        "tool": "refund",
        "call_id": "call-1",
        "arguments": '{"order": "#W1", "amount": 900}',
        "reason": "refunds over 500 need an operator",
        "step": 2,
        "created_at": NOW,
        "metadata": {"channel": "web", "nested": {"k": [1, 2]}},
        "arguments_schema": REFUND_SCHEMA,
    }
    values.update(fields)
    return ApprovalRequest(**values)


def _decision(approve: bool = True, by: str = "operator:olga", **fields: Any) -> ApprovalDecision:
    return ApprovalDecision(approve=approve, by=by, decided_at=time.time(), **fields)


@asynccontextmanager
async def _opened(url: str) -> AsyncIterator[ApprovalStore]:
    backends = Backends.open(load_settings(database=url), memory=False)
    try:
        yield backends.approvals
    finally:
        await backends.aclose()


class ApprovalStoreConformance:
    """Behaviour every approvals backend shares. Provide ``approvals_database_url``."""

    @pytest.fixture
    async def store(self, approvals_database_url: str) -> AsyncIterator[ApprovalStore]:
        async with _opened(approvals_database_url) as opened:
            yield opened

    # --- the contract ---------------------------------------------------------------------

    async def test_a_request_round_trips(self, store: ApprovalStore) -> None:
        made = request(expires_at=NOW + 3600, kind="user", tool="cancel_order")
        assert await store.aadd(made) == made
        assert await store.aget(TENANT, made.id) == made
        assert await store.aget(TENANT, "missing") is None

    async def test_the_arguments_schema_and_the_decisions_channel_round_trip(
        self, store: ApprovalStore
    ) -> None:
        nested = {
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Address"}},
            "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
        }
        with_schema = await store.aadd(request("a", arguments_schema=nested))
        without = await store.aadd(request("b", arguments_schema=None))
        assert await store.aget(TENANT, "a") == with_schema
        assert with_schema.arguments_schema == nested
        assert await store.aget(TENANT, "b") == without and without.arguments_schema is None
        decision = _decision(channel="cli", arguments_digest="ab" * 32)
        decided, _ = await store.adecide(TENANT, "a", "approved", decision)
        assert decided.decision == decision
        assert (await store.alist(TENANT, statuses=("approved",))) == [decided]

    async def test_adding_the_same_id_again_keeps_the_first(self, store: ApprovalStore) -> None:
        first = request()
        await store.aadd(first)
        assert await store.aadd(request(arguments='{"amount": 1}', turn_id="t2")) == first
        assert await store.alist(TENANT) == [first]

    async def test_the_queue_lists_oldest_first_with_its_filters(
        self, store: ApprovalStore
    ) -> None:
        late = await store.aadd(request("b", created_at=NOW + 2))
        early = await store.aadd(request("a", created_at=NOW + 1, user_id="bob", session_id="s2"))
        settled = await store.aadd(request("c", created_at=NOW))
        await store.adecide(TENANT, settled.id, "rejected", _decision(False))
        assert [r.id for r in await store.alist(TENANT)] == ["a", "b"]
        assert [r.id for r in await store.alist(TENANT, user_id="bob")] == [early.id]
        assert [r.id for r in await store.alist(TENANT, session_id="s1")] == [late.id]
        assert [r.id for r in await store.alist(TENANT, limit=1)] == ["a"]
        assert [r.id for r in await store.alist(TENANT, statuses=("rejected",))] == ["c"]
        everything = await store.alist(TENANT, statuses=("pending", "rejected"))
        assert [r.id for r in everything] == ["c", "a", "b"]
        assert await store.alist(TENANT, statuses=()) == []

    async def test_bad_list_arguments_are_usage_errors(self, store: ApprovalStore) -> None:
        with pytest.raises(UsageError, match="limit"):
            await store.alist(TENANT, limit=0)
        with pytest.raises(UsageError, match="statuses"):
            await store.alist(TENANT, statuses=("waiting",))  # type: ignore[arg-type]

    # --- deciding: one compare-and-set ----------------------------------------------------

    async def test_a_decision_settles_a_pending_request_once(self, store: ApprovalStore) -> None:
        await store.aadd(request())
        decision = _decision(note="checked the order", arguments='{"order": "#W1", "amount": 1}')
        decided, settled = await store.adecide(TENANT, "ap-1", "approved", decision)
        assert settled and decided.status == "approved" and decided.decision == decision
        assert await store.aget(TENANT, "ap-1") == decided
        # The same decision sent again (an HTTP retry) settles nothing and reads the first.
        again, settled_again = await store.adecide(TENANT, "ap-1", "approved", decision)
        assert (again, settled_again) == (decided, False)

    async def test_a_second_different_decision_leaves_the_first(self, store: ApprovalStore) -> None:
        await store.aadd(request())
        first = _decision(True, "operator:olga")
        await store.adecide(TENANT, "ap-1", "approved", first)
        late, settled = await store.adecide(TENANT, "ap-1", "rejected", _decision(False, "u:x"))
        assert not settled
        assert (late.status, late.decision) == ("approved", first)
        assert await store.alist(TENANT) == []

    async def test_deciding_an_unknown_request_is_a_key_error(self, store: ApprovalStore) -> None:
        with pytest.raises(KeyError):
            await store.adecide(TENANT, "missing", "approved", _decision())

    async def test_a_decision_must_settle(self, store: ApprovalStore) -> None:
        await store.aadd(request())
        with pytest.raises(UsageError, match="pending"):
            await store.adecide(TENANT, "ap-1", "pending", _decision())
        assert (await store.alist(TENANT))[0].status == "pending"

    async def test_two_deciders_at_once_settle_it_exactly_once(
        self, approvals_database_url: str, store: ApprovalStore
    ) -> None:
        rounds = 8
        for index in range(rounds):
            await store.aadd(request(f"race-{index}"))
        barrier = threading.Barrier(2)
        outcomes: dict[str, list[tuple[str, bool]]] = {"operator:a": [], "operator:b": []}
        failures: list[BaseException] = []

        async def decide_all(by: str) -> None:
            # Its own connections, as another process would have.
            async with _opened(approvals_database_url) as own:
                for index in range(rounds):
                    approve = by == "operator:a"
                    status: ApprovalStatus = "approved" if approve else "rejected"
                    await asyncio.to_thread(barrier.wait)
                    decided, settled = await own.adecide(
                        TENANT, f"race-{index}", status, _decision(approve, by)
                    )
                    assert decided.decision is not None
                    outcomes[by].append((decided.decision.by, settled))

        def run(by: str) -> None:
            try:
                asyncio.run(decide_all(by))
            except BaseException as exc:
                failures.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(by,)) for by in outcomes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        for index in range(rounds):
            (winner_a, settled_a), (winner_b, settled_b) = (
                outcomes["operator:a"][index],
                outcomes["operator:b"][index],
            )
            assert settled_a != settled_b, f"round {index}: both or neither settled it"
            assert winner_a == winner_b == ("operator:a" if settled_a else "operator:b")
            stored = await store.aget(TENANT, f"race-{index}")
            assert stored is not None and stored.decision is not None
            assert stored.decision.by == winner_a

    # --- tenant scoping -------------------------------------------------------------------

    async def test_every_method_is_scoped_by_tenant(self, store: ApprovalStore) -> None:
        ours = await store.aadd(request())
        theirs = await store.aadd(request(tenant_id=OTHER_TENANT, user_id="mallory"))
        assert theirs.tenant_id == OTHER_TENANT  # the same id is another tenant's own request
        assert await store.aget(TENANT, "ap-1") == ours
        assert await store.aget(OTHER_TENANT, "ap-1") == theirs
        assert [r.tenant_id for r in await store.alist(OTHER_TENANT)] == [OTHER_TENANT]
        assert await store.alist("nobody") == []
        with pytest.raises(KeyError):
            await store.adecide("nobody", "ap-1", "approved", _decision())
        decided, _ = await store.adecide(OTHER_TENANT, "ap-1", "approved", _decision())
        assert decided.tenant_id == OTHER_TENANT
        assert await store.aget(TENANT, "ap-1") == ours  # still pending
        assert await store.acancel(OTHER_TENANT, "s1", "reverted") == 0
        assert await store.aget(TENANT, "ap-1") == ours

    # --- expiry ---------------------------------------------------------------------------

    async def test_the_sweep_expires_what_is_past_its_expiry(self, store: ApprovalStore) -> None:
        now = time.time()
        await store.aadd(request("past", expires_at=now - 1))
        await store.aadd(request("future", expires_at=now + 3600))
        await store.aadd(request("never"))
        await store.aadd(request("other", tenant_id=OTHER_TENANT, expires_at=now - 1))
        assert await store.aexpire(now) == 2
        assert await store.aexpire(now) == 0
        past = await store.aget(TENANT, "past")
        assert past is not None and past.status == "expired" and past.status_reason
        assert [r.id for r in await store.alist(TENANT)] == ["future", "never"]

    async def test_a_request_past_its_expiry_is_expired_before_any_sweep(
        self, store: ApprovalStore
    ) -> None:
        now = time.time()
        await store.aadd(request("a", expires_at=now - 1))
        await store.aadd(request("b", expires_at=now - 1))
        await store.aadd(request("c", expires_at=now - 1))
        decided, settled = await store.adecide(TENANT, "a", "approved", _decision())
        assert not settled and decided.status == "expired" and decided.decision is None
        got = await store.aget(TENANT, "b")
        assert got is not None and got.status == "expired"
        assert await store.alist(TENANT) == []
        assert [r.id for r in await store.alist(TENANT, statuses=("expired",))] == ["a", "b", "c"]

    # --- cancellation ---------------------------------------------------------------------

    async def test_cancel_settles_the_sessions_pending_requests(self, store: ApprovalStore) -> None:
        await store.aadd(request("a"))
        await store.aadd(request("b"))
        await store.aadd(request("decided"))
        await store.aadd(request("elsewhere", session_id="s2"))
        first = _decision()
        await store.adecide(TENANT, "decided", "approved", first)
        assert await store.acancel(TENANT, "s1", "the session was reverted") == 2
        cancelled = await store.aget(TENANT, "a")
        assert cancelled is not None
        assert (cancelled.status, cancelled.status_reason) == (
            "cancelled",
            "the session was reverted",
        )
        late, settled = await store.adecide(TENANT, "b", "approved", _decision())
        assert not settled and late.status == "cancelled"
        decided = await store.aget(TENANT, "decided")
        assert decided is not None and (decided.status, decided.decision) == ("approved", first)
        assert [r.id for r in await store.alist(TENANT)] == ["elsewhere"]

    # --- carrying decisions out -----------------------------------------------------------

    async def test_decided_requests_are_left_to_carry_out_until_marked(
        self, store: ApprovalStore
    ) -> None:
        now = time.time()
        await store.aadd(request("waiting", created_at=NOW))
        for index, name in enumerate(("approved", "rejected", "cancelled", "bobs")):
            await store.aadd(
                request(name, created_at=NOW + 1 + index, user_id="bob" if name == "bobs" else "al")
            )
        await store.aadd(
            request("overdue", created_at=NOW + 9, expires_at=now - 1, session_id="s2")
        )
        await store.aadd(request("approved", tenant_id=OTHER_TENANT))
        await store.adecide(TENANT, "approved", "approved", _decision())
        await store.adecide(TENANT, "rejected", "rejected", _decision(False))
        await store.adecide(TENANT, "bobs", "approved", _decision())
        await store.acancel(TENANT, "s1", "reverted")  # "waiting" and "cancelled"
        await store.adecide(OTHER_TENANT, "approved", "approved", _decision())

        left = await store.alist_to_carry_out(TENANT)
        # Decided (the overdue one expired as it is listed), oldest first; never pending nor
        # cancelled, never another tenant's.
        assert [r.id for r in left] == ["approved", "rejected", "bobs", "overdue"]
        assert all(r.carried_out_at is None for r in left)
        assert [r.id for r in await store.alist_to_carry_out(TENANT, user_id="bob")] == ["bobs"]
        first = await store.alist_to_carry_out(TENANT, limit=2)
        after = (first[-1].created_at, first[-1].id)
        rest = await store.alist_to_carry_out(TENANT, after=after, limit=2)
        assert [r.id for r in [*first, *rest]] == ["approved", "rejected", "bobs", "overdue"]

        marked_at = NOW + 100
        assert await store.amark_carried_out(TENANT, ["approved", "overdue"], marked_at) == 2
        # Marked once; a pending, cancelled, unknown or other tenant's request never is.
        assert await store.amark_carried_out(TENANT, ["approved", "cancelled", "nope"]) == 0
        assert await store.amark_carried_out(TENANT, []) == 0
        assert [r.id for r in await store.alist_to_carry_out(TENANT)] == ["rejected", "bobs"]
        carried = await store.aget(TENANT, "approved")
        assert carried is not None and carried.carried_out_at == marked_at
        assert carried.status == "approved"  # the decision itself stands as it was
        assert [r.id for r in await store.alist(TENANT, statuses=("approved",))] == [
            "approved",
            "bobs",
        ]
        assert [r.id for r in await store.alist_to_carry_out(OTHER_TENANT)] == ["approved"]
        cancelled = await store.aget(TENANT, "cancelled")
        assert cancelled is not None and cancelled.carried_out_at is None

    async def test_many_marked_at_once_leave_only_the_new_decision(
        self, store: ApprovalStore
    ) -> None:
        ids = [f"old-{index:04d}" for index in range(1200)]  # more than one batch of markers
        for index, request_id in enumerate(ids):
            await store.aadd(request(request_id, created_at=NOW + index))
            await store.adecide(TENANT, request_id, "approved", _decision())
        assert await store.amark_carried_out(TENANT, ids) == len(ids)
        await store.aadd(request("new", created_at=NOW + 5000))
        await store.adecide(TENANT, "new", "approved", _decision(channel="cli"))
        assert [r.id for r in await store.alist_to_carry_out(TENANT, limit=10)] == ["new"]

    async def test_the_tenants_to_carry_out_are_those_with_decisions_left(
        self, store: ApprovalStore
    ) -> None:
        now = time.time()
        assert await store.atenants_to_carry_out() == []
        await store.aadd(request("pending", tenant_id="waits"))
        await store.aadd(request("done", tenant_id="done"))
        await store.adecide("done", "done", "approved", _decision())
        await store.amark_carried_out("done", ["done"])
        await store.aadd(request("cancelled", tenant_id="cancels"))
        await store.acancel("cancels", "s1", "reverted")
        # Pending, carried out or cancelled: nothing to carry out for those tenants.
        assert await store.atenants_to_carry_out() == []
        await store.aadd(request("approved", tenant_id=TENANT))
        await store.adecide(TENANT, "approved", "approved", _decision())
        await store.aadd(request("overdue", tenant_id=OTHER_TENANT, expires_at=now - 1))
        # Decided, or expired as the tenants are listed; sorted, each once.
        assert await store.atenants_to_carry_out() == sorted([OTHER_TENANT, TENANT])
        overdue = await store.aget(OTHER_TENANT, "overdue")
        assert overdue is not None and overdue.status == "expired"
        await store.amark_carried_out(TENANT, ["approved"])
        assert await store.atenants_to_carry_out() == [OTHER_TENANT]

    async def test_bad_carry_out_arguments_are_usage_errors(self, store: ApprovalStore) -> None:
        with pytest.raises(UsageError, match="limit"):
            await store.alist_to_carry_out(TENANT, limit=0)

    # --- durability -----------------------------------------------------------------------

    async def test_requests_and_decisions_survive_a_reopen(
        self, approvals_database_url: str, store: ApprovalStore
    ) -> None:
        await store.aadd(request("a"))
        decided, _ = await store.adecide(TENANT, "a", "rejected", _decision(False, note="no"))
        waiting = await store.aadd(request("b"))
        await store.amark_carried_out(TENANT, ["a"], NOW)
        async with _opened(approvals_database_url) as reopened:
            assert await reopened.aget(TENANT, "a") == decided.model_copy(
                update={"carried_out_at": NOW}
            )
            assert await reopened.alist(TENANT) == [waiting]
            assert await reopened.alist_to_carry_out(TENANT) == []

    # --- a user's erasure -----------------------------------------------------------------------

    async def test_erase_user_deletes_every_request_of_the_user_and_only_theirs(
        self, store: ApprovalStore
    ) -> None:
        await store.aadd(request("a", session_id="s1"))
        await store.aadd(request("b", session_id="s2"))
        await store.adecide(TENANT, "b", "approved", _decision())
        await store.aadd(request("c", user_id="bob"))
        await store.aadd(request("d", tenant_id="globex"))
        assert await store.auser_sessions(TENANT, "alice") == ["s1", "s2"]
        assert await store.aerase_user(TENANT, "alice") == {"approvals": 2}
        assert await store.aget(TENANT, "a") is None and await store.aget(TENANT, "b") is None
        assert await store.aget(TENANT, "c") is not None
        assert await store.aget("globex", "d") is not None
        assert await store.aerase_user(TENANT, "alice") == {"approvals": 0}
