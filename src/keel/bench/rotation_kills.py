"""A master-key rotation killed at random points, then resumed: does every user stay served?

Workload: ``users`` users of one tenant, each with two values sealed in the vault under the old
master key. ``keel privacy rotate-key`` runs as a real subprocess, SIGKILLed ``kills`` times at
seeded points (once the database shows a seeded number of data keys re-wrapped under the new
key), each rerun alternating the two ways of resuming: the old key configured with the new one
given (``--new-key-env``), or the new key configured with the old one given (``--old-key-env``).
A last run finishes the rotation.

A kill is survived when, afterwards, every value of every user resolves through a vault opened
with the new key and the old one as previous (what a deployment restarted mid-rotation runs
with), and a vault opened with the old key alone either resolves every value too or is refused
at start-up with a ``VaultKeyError`` (never some users served and others not). The count comes
from the values resolved, never from the rotation's own bookkeeping. At the end the new key
alone must resolve everything and the old key must be refused.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from keel.errors import KeelError, VaultKeyError
from keel.privacy import KeyProvider, KeyRing, MasterKey
from keel.settings import load_settings
from keel.stores import Backends

__all__ = ["run_rotation_kills"]

TENANT = "rotation"
_NEW_VARIABLE = "KEEL_ROTATION_NEW_KEY"
_OLD_VARIABLE = "KEEL_ROTATION_OLD_KEY"
_POLL_S = 0.0005
"""How often the database is read for the re-wrap count that triggers a kill."""

Values = dict[str, dict[str, str]]
"""user -> placeholder -> value."""


def run_rotation_kills(
    *,
    users: int,
    kills: int,
    seed: int,
    directory: Path,
    database: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fill a vault, rotate its key with ``kills`` SIGKILLs, finish, and check every value.

    Args:
        users: users holding two values each.
        kills: SIGKILLs of the rotation, each at a seeded point.
        seed: where the kills fall.
        directory: where the SQLite file goes (``database`` unset).
        database: a PostgreSQL URL to use instead (an empty database).
        progress: told what happens, one line at a time.
    """
    say = progress or (lambda _: None)
    url = database or f"sqlite:///{directory / 'rotation.db'}"
    old, new = MasterKey.new_key_text(), MasterKey.new_key_text()
    old_key, new_key = MasterKey.from_text(old), MasterKey.from_text(new)
    rng = random.Random(seed)
    say(f"rotation kills: seed {seed}, {users} users, {kills} kills")
    values = _fill(url, old_key, users, rng)
    survived = 0
    killed = 0
    for attempt in range(kills):
        done = _rewrapped(url, new_key.key_id)
        remaining = users - done
        target = done + max(1, int(remaining * rng.uniform(0.05, 0.6)))
        outcome = _run_rotation(url, old, new, finishing=attempt % 2 == 1, kill_at=target)
        if outcome != "killed":
            say(f"kill {attempt + 1}: the rotation ended first ({outcome})")
            continue
        killed += 1
        ring_serves = _resolves_all(url, KeyRing(new_key, [old_key]), values)
        old_alone = _old_alone(url, old_key, values)
        say(
            f"kill {attempt + 1} at {_rewrapped(url, new_key.key_id)} of {users} re-wrapped: "
            f"new+previous {'serves everyone' if ring_serves else 'FAILS'}, old alone {old_alone}"
        )
        survived += ring_serves and old_alone in ("serves everyone", "refused")
    finished = _run_rotation(url, old, new, finishing=kills % 2 == 1, kill_at=None)
    new_alone = _resolves_all(url, new_key, values)
    old_refused = _old_alone(url, old_key, values) == "refused"
    say(
        f"resumed: {finished}; new key alone serves everyone: {new_alone}; old key refused: "
        f"{old_refused}"
    )
    return {
        "rotation_seed": seed,
        "rotation_users": users,
        "rotation_kills": killed,
        "rotation_kills_survived": survived,
        "rotation_finished": finished == "exit 0" and new_alone and old_refused,
    }


def _settings(url: str) -> Any:
    return load_settings(database=url, redis_url="")


def _open(url: str, keys: KeyProvider | KeyRing) -> Backends:
    return Backends.open(_settings(url), memory=False, pii_key=keys)


def _fill(url: str, key: MasterKey, users: int, rng: random.Random) -> Values:
    values: Values = {}
    with _open(url, key) as backends:
        assert backends.vault is not None
        for index in range(users):
            user = f"user-{index:05d}"
            pairs = [
                ("EMAIL", f"{user}.{rng.randrange(10**6)}@example.org"),
                ("PHONE", f"+1 415 555 {rng.randrange(10**4):04d}"),
            ]
            placed = backends.vault.user(TENANT, user).placeholders(pairs)
            values[user] = {
                placeholder: value for placeholder, (_, value) in zip(placed, pairs, strict=True)
            }
    return values


def _resolves_all(url: str, keys: KeyProvider | KeyRing, values: Values) -> bool:
    """Whether every value of every user resolves through a vault opened with ``keys``."""
    try:
        with _open(url, keys) as backends:
            assert backends.vault is not None
            return all(
                backends.vault.user(TENANT, user).values(placed) == placed
                for user, placed in values.items()
            )
    except KeelError:
        return False


def _old_alone(url: str, old: MasterKey, values: Values) -> str:
    try:
        backends = _open(url, old)
    except VaultKeyError:
        return "refused"
    with backends:
        assert backends.vault is not None
        failed = 0
        for user, placed in values.items():
            try:
                failed += backends.vault.user(TENANT, user).values(placed) != placed
            except KeelError:
                failed += 1
    return "serves everyone" if failed == 0 else f"FAILS {failed} users"


def _run_rotation(url: str, old: str, new: str, *, finishing: bool, kill_at: int | None) -> str:
    """Run ``keel privacy rotate-key`` (the new key configured and the old one given when
    ``finishing``, else the other way round); SIGKILL it once ``kill_at`` data keys are
    wrapped by the new key. "killed", or how it exited."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KEEL_PII_KEY")}
    env |= {"KEEL_PII_KEY": new if finishing else old, _NEW_VARIABLE: new, _OLD_VARIABLE: old}
    given = ["--old-key-env", _OLD_VARIABLE] if finishing else ["--new-key-env", _NEW_VARIABLE]
    command = [sys.executable, "-m", "keel", "privacy", "rotate-key", *given, "--database", url]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    new_id = MasterKey.from_text(new).key_id
    with closing(_Counter(url, new_id)) as counter:
        while kill_at is not None and process.poll() is None:
            if counter.rewrapped() >= kill_at:
                process.send_signal(signal.SIGKILL)
                process.communicate()
                return "killed"
            time.sleep(_POLL_S)
    _, stderr = process.communicate()
    if process.returncode != 0:
        return f"exit {process.returncode}: {stderr.strip()[-300:]}"
    return "exit 0"


def _rewrapped(url: str, key_id: str) -> int:
    with closing(_Counter(url, key_id)) as counter:
        return counter.rewrapped()


class _Counter:
    """Counts the data keys wrapped by one master key, read straight from the database."""

    def __init__(self, url: str, key_id: str) -> None:
        self._key_id = key_id
        path = _settings(url).sqlite_path
        if path is not None:
            import sqlite3

            self._conn: Any = sqlite3.connect(path, isolation_level=None)
            self._sql = "SELECT COUNT(*) FROM keel_pii_keys WHERE key_id = ?"
        else:
            import psycopg

            self._conn = psycopg.connect(_settings(url).parsed_database.url, autocommit=True)
            self._sql = "SELECT COUNT(*) FROM keel_pii_keys WHERE key_id = %s"

    def rewrapped(self) -> int:
        return int(self._conn.execute(self._sql, (self._key_id,)).fetchone()[0])

    def close(self) -> None:
        self._conn.close()
