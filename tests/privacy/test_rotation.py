"""A master-key rotation: killed at random points (a real ``keel privacy rotate-key`` process,
SIGKILLed) and resumed with either key, every value of every user resolves; a deployment
restarted mid-rotation is served with both keys, and refused with one of them, saying why."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from keel.bench.rotation_kills import run_rotation_kills
from keel.errors import VaultKeyError
from keel.privacy import KeyRing, MasterKey, StoredKey
from keel.privacy._vault import _owner
from keel.settings import Settings, load_settings
from keel.stores import Backends

USERS = ("alice", "bob", "carol")


def _seed() -> int:
    seed = int(os.environ.get("KEEL_TEST_SEED") or random.randrange(2**32))
    print(f"seed {seed} (KEEL_TEST_SEED={seed} replays it)")
    return seed


@pytest.mark.parametrize(
    ("users", "database"),
    [(3000, "sqlite"), pytest.param(1500, "postgres", marks=pytest.mark.postgres)],
)
def test_a_rotation_killed_at_random_points_resumes_and_every_value_resolves(
    tmp_path: Path, request: pytest.FixtureRequest, users: int, database: str
) -> None:
    url = request.getfixturevalue("postgres_url") if database == "postgres" else None
    figures = run_rotation_kills(
        users=users, kills=5, seed=_seed(), directory=tmp_path, database=url, progress=print
    )
    assert figures["rotation_kills"] == 5
    assert figures["rotation_kills_survived"] == 5
    assert figures["rotation_finished"] is True


def _half_rotated(settings: Settings, old: MasterKey, new: MasterKey) -> dict[str, str]:
    """A vault whose rotation from ``old`` to ``new`` stopped after one user, as a killed
    run leaves it: the new key's check sealed, one data key re-wrapped."""
    placed = {}
    with Backends.open(settings, memory=False, pii_key=old) as backends:
        assert backends.vault is not None
        for user in USERS:
            placed[user] = backends.vault.user("acme", user).placeholder(
                "EMAIL", f"{user}@example.org"
            )
        store = backends.vault.store
        check = StoredKey(new.wrap(b"keel pii vault key check", _owner("", "")), new.key_id)
        assert store.add_key_check(check)
        stored = store.data_key("acme", "alice")
        assert stored is not None
        context = _owner("acme", "alice")
        rewrapped = StoredKey(new.wrap(old.unwrap(stored.wrapped, context), context), new.key_id)
        assert store.rewrap("acme", "alice", stored, rewrapped)
    return placed


def _serves_everyone(backends: Backends, placed: dict[str, str]) -> None:
    assert backends.vault is not None
    for user, placeholder in placed.items():
        assert backends.vault.user("acme", user).resolve(placeholder) == f"{user}@example.org"


def test_a_half_done_rotation_serves_everyone_with_both_keys_and_refuses_either_alone(
    tmp_path: Path,
) -> None:
    settings = load_settings(data_dir=tmp_path)
    old_text, new_text = MasterKey.new_key_text(), MasterKey.new_key_text()
    old, new = MasterKey.from_text(old_text), MasterKey.from_text(new_text)
    placed = _half_rotated(settings, old, new)
    for alone, other in ((old, new), (new, old)):
        with pytest.raises(VaultKeyError, match="unfinished") as raised:
            Backends.open(settings, memory=False, pii_key=alone)
        assert other.key_id in str(raised.value) and "KEEL_PII_KEY_PREVIOUS" in str(raised.value)
    for ring in (KeyRing(new, [old]), KeyRing(old, [new])):
        with Backends.open(settings, memory=False, pii_key=ring) as backends:
            _serves_everyone(backends, placed)
    # As a deployment gives them: the new key, the old one as KEEL_PII_KEY_PREVIOUS.
    with_previous = load_settings(data_dir=tmp_path, pii_key=new_text, pii_key_previous=old_text)
    with Backends.open(with_previous, memory=False) as backends:
        _serves_everyone(backends, placed)
        assert backends.vault is not None
        assert backends.vault.rotate(new) == 2
    with Backends.open(settings, memory=False, pii_key=new) as backends:
        _serves_everyone(backends, placed)
    with pytest.raises(VaultKeyError, match="not this vault's"):
        Backends.open(settings, memory=False, pii_key=old)
    # A previous key the vault no longer knows is harmless (and never used).
    with Backends.open(with_previous, memory=False) as backends:
        _serves_everyone(backends, placed)


def test_a_previous_key_alone_is_refused(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, pii_key_previous=MasterKey.new_key_text())
    with pytest.raises(VaultKeyError, match="without KEEL_PII_KEY"):
        Backends.open(settings, memory=False)
