"""The conformance suite every [`keel.privacy.VaultStore`][] backend must pass.

Subclass `VaultStoreConformance` in a test module and provide a ``make_store`` fixture:
a callable that opens the backend (calling it twice in one test must open the SAME database,
as a restarted process would):

```python
class TestMyVaultStore(VaultStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path):
        database = SQLiteDatabase(tmp_path / "vault.db")
        return lambda: SQLiteVaultStore(database)
```

The suite checks each method's contract on opaque bytes (the store never sees a key or a value
in the clear): one key check per master key, dropped only once no data key is wrapped by
that key, the re-wrap's compare-and-set, one data key per user, numbers
per user and entity from 1 that are never reused (not even after ``forget``), ``add_value``
refusing a key that is no longer the user's (``add_values`` too, a batch numbered in order,
a token given twice numbered once), and scoping: another user of the same tenant, and
the same user id in another tenant, see and change nothing of the user's. Races are forced
with a `threading.Barrier`: two writers of one value get one number, of two values
two, and two batches sharing a value agree on its number.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from keel.privacy import StoredKey, VaultStore

__all__ = ["StoreFactory", "VaultStoreConformance"]

StoreFactory = Callable[[], VaultStore]

ALICE = ("acme", "alice")
BOB = ("acme", "bob")
EVE = ("evil-corp", "alice")
OTHERS = (BOB, EVE)
"""ALICE's neighbours: same tenant, another user; another tenant, the same user id."""

_RACES = 8
"""Rounds of each forced race (each round a fresh pair of writers at one barrier)."""


MASTER = "conformance-master-key"
"""The master key id the suite's data keys name; every test's store has its check."""


def _key(key_id: str = MASTER) -> StoredKey:
    # Opaque bytes with a zero byte in them: a store must keep bytes, not text.
    return StoredKey(b"\x01\x00" + secrets.token_bytes(40), key_id)


def _token() -> bytes:
    return b"\x00" + secrets.token_bytes(31)


def _sealed() -> bytes:
    return secrets.token_bytes(12) + b"\x00\xff" + secrets.token_bytes(30)


def _with_key(store: VaultStore, owner: tuple[str, str]) -> StoredKey:
    stored = store.add_data_key(*owner, _key())
    assert stored is not None
    return stored


def _race(calls: list[Callable[[], object]]) -> list[object]:
    """Run ``calls`` at once, each in its own thread, released together by a barrier."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], object]) -> object:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


class VaultStoreConformance:
    """Behaviour every vault store shares. Provide a ``make_store`` fixture."""

    @pytest.fixture(autouse=True)
    def _master_key_check(self, make_store: StoreFactory) -> None:
        """The check of the master key that wraps the suite's data keys (a store refuses a
        data key under a master key without one)."""
        make_store().add_key_check(StoredKey(b"check", MASTER))

    # --- the master keys' checks ----------------------------------------------------------------

    def test_one_key_check_per_master_key_set_once(self, make_store: StoreFactory) -> None:
        store = make_store()
        [master] = store.key_checks()
        first, second = _key("first"), _key("second")
        assert store.add_key_check(first) is True
        assert store.add_key_check(StoredKey(b"another", first.key_id)) is False
        assert store.add_key_check(second) is True
        checks = sorted(make_store().key_checks(), key=lambda check: check.key_id)
        assert checks == sorted([master, first, second], key=lambda check: check.key_id)

    def test_a_data_key_under_a_master_key_without_a_check_is_refused(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        assert store.add_data_key(*ALICE, _key("rotated-away")) is None
        assert store.data_key(*ALICE) is None
        old = _key("old")
        store.add_key_check(old)
        alice = store.add_data_key(*ALICE, StoredKey(b"alice", old.key_id))
        assert alice is not None and store.rewrap(*ALICE, alice, _key()) is True
        assert store.drop_key_check(old.key_id) is True
        assert store.add_data_key(*BOB, StoredKey(b"bob", old.key_id)) is None
        assert store.data_key(*BOB) is None

    def test_a_check_dropped_while_data_keys_are_added_under_it_never_strands_one(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        for round_ in range(_RACES):
            old = _key(f"racing-{round_}")
            store.add_key_check(old)
            owner = ("acme", f"late-{round_}")
            added, dropped = _race(
                [
                    partial(store.add_data_key, *owner, StoredKey(b"late", old.key_id)),
                    partial(store.drop_key_check, old.key_id),
                ]
            )
            # Either the key came first (the check stays) or the drop did (no key stored).
            assert (added is None) == (dropped is True)
            assert (store.wrapped_by(old.key_id) == 0) == (dropped is True)

    def test_a_key_check_is_dropped_only_once_no_data_key_is_wrapped_by_its_key(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        old, new = _key("old"), _key("new")
        store.add_key_check(old)
        store.add_key_check(new)
        alice = store.add_data_key(*ALICE, StoredKey(b"alice", old.key_id))
        store.add_data_key(*BOB, StoredKey(b"bob", old.key_id))
        assert alice is not None and store.wrapped_by(old.key_id) == 2
        assert store.drop_key_check(old.key_id) is False
        assert store.rewrap(*ALICE, alice, StoredKey(b"alice2", new.key_id)) is True
        assert (store.wrapped_by(old.key_id), store.wrapped_by(new.key_id)) == (1, 1)
        assert store.drop_key_check(old.key_id) is False
        store.forget(*BOB)
        assert store.drop_key_check(old.key_id) is True
        assert store.drop_key_check(old.key_id) is False
        assert {check.key_id for check in make_store().key_checks()} == {MASTER, new.key_id}

    def test_the_key_check_is_no_users_data_key(self, make_store: StoreFactory) -> None:
        store = make_store()
        store.add_key_check(_key("check"))
        assert list(store.data_keys()) == []
        assert store.wrapped_by("check") == 0

    # --- data keys ------------------------------------------------------------------------------

    def test_a_user_has_one_data_key_the_first_one_stored(self, make_store: StoreFactory) -> None:
        store = make_store()
        assert store.data_key(*ALICE) is None
        first, second = _key(), _key()
        assert store.add_data_key(*ALICE, first) == first
        assert store.add_data_key(*ALICE, second) == first
        assert make_store().data_key(*ALICE) == first
        for other in OTHERS:
            assert store.data_key(*other) is None

    def test_concurrent_first_keys_agree_on_one(self, make_store: StoreFactory) -> None:
        store = make_store()
        for round_ in range(_RACES):
            owner = ("acme", f"racer-{round_}")
            keys = [_key(), _key()]
            stood = _race([partial(store.add_data_key, *owner, key) for key in keys])
            assert stood[0] == stood[1] and stood[0] in keys
            assert store.data_key(*owner) == stood[0]

    def test_data_keys_lists_every_user_across_tenants_and_pages(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        # More users than one page of the SQL stores (500), in two tenants and out of order.
        expected = {}
        for index in range(1203):
            owner = (f"tenant-{index % 2}", f"user-{(index * 7919) % 1203:05d}")
            expected[owner] = store.add_data_key(*owner, _key())
        store.add_key_check(_key("check"))
        listed = [((tenant, user), key) for tenant, user, key in store.data_keys()]
        assert len(listed) == len(expected)
        assert dict(listed) == expected

    def test_rewrap_replaces_only_the_key_it_was_given(self, make_store: StoreFactory) -> None:
        store = make_store()
        old = _with_key(store, ALICE)
        bob = _with_key(store, BOB)
        new, newer = _key("new"), _key("newer")
        assert store.rewrap(*ALICE, _key("stale"), new) is False
        assert store.rewrap(*ALICE, StoredKey(old.wrapped, "another id"), new) is False
        assert store.data_key(*ALICE) == old
        assert store.rewrap(*ALICE, old, new) is True
        assert store.rewrap(*ALICE, old, newer) is False
        assert store.data_key(*ALICE) == new
        assert store.data_key(*BOB) == bob
        assert store.rewrap(*EVE, new, newer) is False
        assert store.data_key(*EVE) is None
        store.forget(*ALICE)
        assert store.rewrap(*ALICE, new, newer) is False
        assert store.data_key(*ALICE) is None

    # --- values ---------------------------------------------------------------------------------

    def test_values_are_numbered_per_user_and_entity_from_one(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        emails = [(_token(), _sealed()) for _ in range(3)]
        phone = (_token(), _sealed())
        numbers = [store.add_value(*ALICE, "EMAIL", t, s, key=key) for t, s in emails]
        assert numbers == [1, 2, 3]
        assert store.add_value(*ALICE, "PHONE", *phone, key=key) == 1
        bob_key = _with_key(store, BOB)
        assert store.add_value(*BOB, "EMAIL", _token(), _sealed(), key=bob_key) == 1
        reopened = make_store()
        assert reopened.numbers(*ALICE, [t for t, _ in emails] + [phone[0]]) == {
            emails[0][0]: ("EMAIL", 1),
            emails[1][0]: ("EMAIL", 2),
            emails[2][0]: ("EMAIL", 3),
            phone[0]: ("PHONE", 1),
        }
        assert reopened.sealed(*ALICE, [("EMAIL", 2), ("PHONE", 1)]) == {
            ("EMAIL", 2): emails[1],
            ("PHONE", 1): phone,
        }

    def test_a_stored_token_keeps_its_number(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        token, sealed = _token(), _sealed()
        assert store.add_value(*ALICE, "EMAIL", token, sealed, key=key) == 1
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key) == 1
        assert store.add_value(*ALICE, "EMAIL", _token(), _sealed(), key=key) == 2
        # The first sealing stands: a repeat stores nothing.
        assert store.sealed(*ALICE, [("EMAIL", 1)]) == {("EMAIL", 1): (token, sealed)}

    def test_lookups_leave_out_what_the_user_never_had(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        token = _token()
        store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key)
        assert store.numbers(*ALICE, [_token(), _token()]) == {}
        assert store.numbers(*ALICE, []) == {}
        assert store.sealed(*ALICE, [("EMAIL", 2), ("PHONE", 1)]) == {}
        assert store.sealed(*ALICE, []) == {}
        assert store.numbers(*ALICE, [token, token]) == {token: ("EMAIL", 1)}

    def test_many_lookups_at_once(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        tokens = [_token() for _ in range(620)]
        for token in tokens:
            store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key)
        found = store.numbers(*ALICE, tokens)
        assert sorted(number for _, number in found.values()) == list(range(1, 621))
        refs = [("EMAIL", number) for number in range(1, 622)]
        assert len(store.sealed(*ALICE, refs)) == 620

    def test_add_value_stores_nothing_under_a_key_that_is_not_the_users(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        token = _token()
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=_key()) is None
        key = _with_key(store, ALICE)
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=_key()) is None
        renamed = StoredKey(key.wrapped, "another id")
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=renamed) is None
        assert store.numbers(*ALICE, [token]) == {}
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key) == 1
        assert store.numbers(*ALICE, [token]) == {token: ("EMAIL", 1)}
        store.forget(*ALICE)
        assert store.add_value(*ALICE, "EMAIL", _token(), _sealed(), key=key) is None

    def test_add_value_under_another_users_key_is_refused(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        for other in OTHERS:
            token = _token()
            assert store.add_value(*other, "EMAIL", token, _sealed(), key=key) is None
            assert store.numbers(*other, [token]) == {}

    def test_add_values_numbers_a_batch_in_order(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        stored = (_token(), _sealed())
        assert store.add_values(*ALICE, [("EMAIL", *stored)], key=key) == [1]
        repeated, phone, email = _token(), (_token(), _sealed()), (_token(), _sealed())
        batch = [
            ("PHONE", *phone),
            ("EMAIL", repeated, _sealed()),
            ("EMAIL", stored[0], _sealed()),  # stored already: keeps its number
            ("EMAIL", repeated, _sealed()),  # twice in the batch: one number
            ("EMAIL", *email),
        ]
        assert store.add_values(*ALICE, batch, key=key) == [1, 2, 1, 2, 3]
        assert store.add_values(*ALICE, [], key=key) == []
        reopened = make_store()
        assert reopened.numbers(*ALICE, [repeated, email[0], phone[0]]) == {
            repeated: ("EMAIL", 2),
            email[0]: ("EMAIL", 3),
            phone[0]: ("PHONE", 1),
        }
        # The first sealing of a token stands.
        assert reopened.sealed(*ALICE, [("EMAIL", 1), ("PHONE", 1), ("EMAIL", 3)]) == {
            ("EMAIL", 1): stored,
            ("PHONE", 1): phone,
            ("EMAIL", 3): email,
        }

    def test_add_values_stores_nothing_under_a_key_that_is_not_the_users(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        batch = [("EMAIL", _token(), _sealed()), ("PHONE", _token(), _sealed())]
        tokens = [token for _, token, _ in batch]
        assert store.add_values(*ALICE, batch, key=_key()) is None
        key = _with_key(store, ALICE)
        for wrong in (_key(), StoredKey(key.wrapped, "another id")):
            assert store.add_values(*ALICE, batch, key=wrong) is None
        assert store.add_values(*BOB, batch, key=key) is None
        assert store.numbers(*ALICE, tokens) == {}
        assert store.numbers(*BOB, tokens) == {}
        assert store.add_values(*ALICE, batch, key=key) == [1, 1]
        store.forget(*ALICE)
        assert store.add_values(*ALICE, [("EMAIL", _token(), _sealed())], key=key) is None

    def test_add_values_never_reuses_a_forgotten_number(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        store.add_values(*ALICE, [("EMAIL", _token(), _sealed()) for _ in range(2)], key=key)
        store.forget(*ALICE)
        fresh = _with_key(store, ALICE)
        batch = [("EMAIL", _token(), _sealed()), ("EMAIL", _token(), _sealed())]
        assert store.add_values(*ALICE, batch, key=fresh) == [3, 4]

    # --- scoping --------------------------------------------------------------------------------

    def test_another_user_or_tenant_sees_none_of_the_users_values(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        token = _token()
        store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key)
        for other in OTHERS:
            assert store.data_key(*other) is None
            assert store.numbers(*other, [token]) == {}
            assert store.sealed(*other, [("EMAIL", 1)]) == {}
            other_key = _with_key(store, other)
            # Their own first email is their number 1, however many ALICE has.
            assert store.add_value(*other, "EMAIL", token, _sealed(), key=other_key) == 1
        assert store.numbers(*ALICE, [token]) == {token: ("EMAIL", 1)}

    def test_forget_erases_only_the_user(self, make_store: StoreFactory) -> None:
        store = make_store()
        kept: dict[tuple[str, str], tuple[StoredKey, bytes, bytes]] = {}
        for owner in (ALICE, *OTHERS):
            key = _with_key(store, owner)
            token, sealed = _token(), _sealed()
            store.add_value(*owner, "EMAIL", token, sealed, key=key)
            kept[owner] = (key, token, sealed)
        assert store.forget(*ALICE) == 1
        for other in OTHERS:
            key, token, sealed = kept[other]
            assert store.data_key(*other) == key
            assert store.numbers(*other, [token]) == {token: ("EMAIL", 1)}
            assert store.sealed(*other, [("EMAIL", 1)]) == {("EMAIL", 1): (token, sealed)}
            assert store.forget(*other) == 1

    # --- forget ---------------------------------------------------------------------------------

    def test_forget_deletes_the_key_and_every_token_and_sealed_value(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        tokens = [_token() for _ in range(3)]
        for token in tokens[:2]:
            store.add_value(*ALICE, "EMAIL", token, _sealed(), key=key)
        store.add_value(*ALICE, "PHONE", tokens[2], _sealed(), key=key)
        assert store.forget(*ALICE) == 3
        reopened = make_store()
        assert reopened.data_key(*ALICE) is None
        assert reopened.numbers(*ALICE, tokens) == {}
        refs = [("EMAIL", 1), ("EMAIL", 2), ("PHONE", 1), ("PHONE", 2)]
        # Forgotten refs are None (the placeholder was the user's), unknown ones left out.
        assert reopened.sealed(*ALICE, refs) == {
            ("EMAIL", 1): None,
            ("EMAIL", 2): None,
            ("PHONE", 1): None,
        }
        assert (ALICE[0], ALICE[1]) not in {(t, u) for t, u, _ in reopened.data_keys()}
        assert reopened.forget(*ALICE) == 0

    def test_numbers_are_never_reused_after_forget(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        token = _token()
        for value_token in (token, _token()):
            store.add_value(*ALICE, "EMAIL", value_token, _sealed(), key=key)
        store.forget(*ALICE)
        fresh = _with_key(store, ALICE)
        assert fresh != key
        # The same value again (its token under a new key would differ; here even the same
        # bytes) takes the next number: a forgotten placeholder never comes back to life.
        assert store.add_value(*ALICE, "EMAIL", token, _sealed(), key=fresh) == 3
        assert store.add_value(*ALICE, "PHONE", _token(), _sealed(), key=fresh) == 1
        assert store.sealed(*ALICE, [("EMAIL", 1)]) == {("EMAIL", 1): None}

    # --- races ----------------------------------------------------------------------------------

    def test_two_writers_of_one_value_get_one_number(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        for round_ in range(_RACES):
            token = _token()
            sealings = [_sealed(), _sealed()]
            got = _race(
                [
                    partial(store.add_value, *ALICE, "EMAIL", token, sealed, key=key)
                    for sealed in sealings
                ]
            )
            assert got == [round_ + 1, round_ + 1]
            assert store.numbers(*ALICE, [token]) == {token: ("EMAIL", round_ + 1)}
            stored = store.sealed(*ALICE, [("EMAIL", round_ + 1)])[("EMAIL", round_ + 1)]
            assert stored is not None and stored[1] in sealings

    def test_two_writers_of_two_values_get_two_numbers(self, make_store: StoreFactory) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        for round_ in range(_RACES):
            tokens = [_token(), _token()]
            got = _race(
                [
                    partial(store.add_value, *ALICE, "EMAIL", token, _sealed(), key=key)
                    for token in tokens
                ]
            )
            assert sorted(got) == [2 * round_ + 1, 2 * round_ + 2]  # type: ignore[type-var]
            assert store.numbers(*ALICE, tokens) == {
                token: ("EMAIL", number) for token, number in zip(tokens, got, strict=True)
            }

    def test_two_batches_sharing_values_agree_on_their_numbers(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        key = _with_key(store, ALICE)
        for round_ in range(_RACES):
            shared, own = _token(), [_token(), _token()]
            batches = [[("EMAIL", shared, _sealed()), ("EMAIL", token, _sealed())] for token in own]
            got = _race([partial(store.add_values, *ALICE, batch, key=key) for batch in batches])
            first, second = got
            assert isinstance(first, list) and isinstance(second, list)
            assert first[0] == second[0]  # one number for the value both gave
            assert sorted([first[0], first[1], second[1]]) == [
                3 * round_ + 1,
                3 * round_ + 2,
                3 * round_ + 3,
            ]
            assert store.numbers(*ALICE, [shared, *own]) == {
                shared: ("EMAIL", first[0]),
                own[0]: ("EMAIL", first[1]),
                own[1]: ("EMAIL", second[1]),
            }

    def test_a_batch_racing_forget_is_erased_or_never_stored(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        for round_ in range(_RACES):
            owner = ("acme", f"batch-forgotten-{round_}")
            key = _with_key(store, owner)
            batch = [("EMAIL", _token(), _sealed()), ("PHONE", _token(), _sealed())]
            added, _ = _race(
                [
                    partial(store.add_values, *owner, batch, key=key),
                    partial(store.forget, *owner),
                ]
            )
            assert store.data_key(*owner) is None
            assert store.numbers(*owner, [token for _, token, _ in batch]) == {}
            refs = [("EMAIL", 1), ("PHONE", 1)]
            if added is not None:  # stored first, then erased by the forget
                assert added == [1, 1]
                assert store.sealed(*owner, refs) == dict.fromkeys(refs)
            else:
                # Refused: nothing of it can be read. A store whose batch is not one
                # transaction (the interface's default, value by value) may have stored part
                # of it before the forget: erased with the rest, never readable.
                assert all(row is None for row in store.sealed(*owner, refs).values())

    def test_a_value_racing_forget_is_erased_or_never_stored(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        for round_ in range(_RACES):
            owner = ("acme", f"forgotten-{round_}")
            key = _with_key(store, owner)
            token = _token()
            added, _ = _race(
                [
                    partial(store.add_value, *owner, "EMAIL", token, _sealed(), key=key),
                    partial(store.forget, *owner),
                ]
            )
            assert store.data_key(*owner) is None
            assert store.numbers(*owner, [token]) == {}
            if added is not None:  # stored first, then erased by the forget
                assert store.sealed(*owner, [("EMAIL", 1)]) == {("EMAIL", 1): None}
            else:
                assert store.sealed(*owner, [("EMAIL", 1)]) == {}

    def test_concurrent_rewraps_of_one_key_let_one_win(self, make_store: StoreFactory) -> None:
        store = make_store()
        for round_ in range(_RACES):
            owner = ("acme", f"rotated-{round_}")
            old = _with_key(store, owner)
            news = [_key("a"), _key("b")]
            won = _race([partial(store.rewrap, *owner, old, new) for new in news])
            assert sorted(won) == [False, True]  # type: ignore[type-var]
            assert store.data_key(*owner) == news[won.index(True)]

    # --- a user's whole erasure ------------------------------------------------------------------

    def test_erase_user_deletes_every_row_of_the_user_and_only_theirs(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        kept: dict[tuple[str, str], tuple[StoredKey, bytes]] = {}
        for owner in (ALICE, *OTHERS):
            key = _with_key(store, owner)
            token = _token()
            store.add_value(*owner, "EMAIL", token, _sealed(), key=key)
            kept[owner] = (key, token)
        store.add_value(*ALICE, "PHONE", _token(), _sealed(), key=kept[ALICE][0])
        store.forget(*ALICE)  # a forgotten value's row (its number) goes too
        assert store.erase_user(*ALICE) == {"pii_keys": 0, "pii_values": 2}
        _with_key(store, ALICE)
        assert store.erase_user(*ALICE) == {"pii_keys": 1, "pii_values": 0}
        reopened = make_store()
        assert reopened.data_key(*ALICE) is None
        assert reopened.sealed(*ALICE, [("EMAIL", 1), ("PHONE", 1)]) == {}
        for other in OTHERS:
            key, token = kept[other]
            assert reopened.data_key(*other) == key
            assert reopened.numbers(*other, [token]) == {token: ("EMAIL", 1)}
        assert reopened.erase_user(*ALICE) == {"pii_keys": 0, "pii_values": 0}
