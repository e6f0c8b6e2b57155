"""A user's erasure on SQLite, through the CLI and through the operator's HTTP route: after
real turns (memory, a journaled tool call, an approval, traces, the vault), every table of the
database is read back and holds nothing of the user, and everything of the same user id in
another tenant and of their neighbour is still there. Killed half-way, a rerun finishes."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.errors import StoreError
from keel.memory import Memory, MemoryFilter, Scope
from keel.privacy import MasterKey
from keel.service import APIKeys, build_service
from keel.settings import Settings, load_settings
from keel.stores import Backends, SQLiteDatabase, SQLiteMemoryStore, SQLTraceStore, erase_user
from keel.testing import ScriptedModel
from tests.cli import keel_process
from tests.privacy._erasure_checks import assert_erased_only, assert_found_before
from tests.privacy._erasure_world import (
    ERASED,
    NEIGHBOURLY,
    TENANT,
    USER,
    _policy,
    book,
    left_of,
    populate,
    refund,
    scan,
)
from tests.service.conftest import serving


def _world(tmp_path: Path) -> tuple[str, Settings]:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = load_settings(embedder="hashing:64", pii_key=MasterKey.new_key_text())
    populate(url, settings)
    return url, settings


def test_the_cli_erases_the_user_from_every_table_and_no_one_else(tmp_path: Path) -> None:
    url, _ = _world(tmp_path)
    with SQLiteDatabase(tmp_path / "keel.db") as database:
        APIKeys(database).create(TENANT, USER)  # their API key goes too
    before = scan(url)
    assert_found_before(before)
    assert "keel_api_keys" in {t for tables in left_of(ERASED, before).values() for t in tables}

    result = keel_process("users", "erase", TENANT, USER, "--database", url, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["removed"]["service"] == {"api_keys": 1, "ui_sessions": 0}
    # Their turns ended, so their sessions' leases were given back: none held, none counted.
    assert report["removed"]["state"]["leases"] == 0
    assert_erased_only(before, scan(url), report)

    settings = load_settings(embedder="hashing:64")
    with Backends.open(url, settings=settings, background=False, vault=False) as backends:
        assert erase_user(backends, TENANT, USER).total == 0  # idempotent
    with sqlite3.connect(tmp_path / "keel.db") as conn:
        audit = conn.execute("SELECT tenant_id, requested_by, finished_at FROM keel_erasures")
        rows = list(audit)
    # One audit row per erasure, finished, with counts and no user (the scan found none).
    assert len(rows) == 2 and all(row[:2] == (TENANT, "cli") and row[2] for row in rows)


def test_the_operator_route_erases_the_user_and_a_user_key_cannot(tmp_path: Path) -> None:
    url, settings = _world(tmp_path)
    app, agents, keys = build_service(
        url, model=ScriptedModel(_policy), tools=[book, refund], memory=True, settings=settings
    )
    operator, own_key = keys.create(TENANT), keys.create(TENANT, USER)
    before = scan(url)
    assert_found_before(before)
    body = {"user_id": USER}
    with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        refused = client.post(
            "/v1/privacy/erase", json=body, headers={"Authorization": f"Bearer {own_key}"}
        )
        assert refused.status_code == 404, refused.text
        assert left_of(ERASED, scan(url)) == left_of(ERASED, before)
        answer = client.post(
            "/v1/privacy/erase", json=body, headers={"Authorization": f"Bearer {operator}"}
        )
        assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["tenant_id"] == TENANT
    assert report["removed"]["service"] == {"api_keys": 1, "ui_sessions": 0}
    assert agents.backends.sql is not None
    assert_erased_only(before, scan(url), report)


def test_an_erasure_killed_half_way_is_finished_by_a_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, settings = _world(tmp_path)
    before = scan(url)

    def crash(self: SQLTraceStore, tenant_id: str, user_id: str) -> dict[str, int]:
        raise RuntimeError("killed")

    with Backends.open(url, settings=settings, background=False) as backends:
        with monkeypatch.context() as patched:
            patched.setattr(SQLTraceStore, "erase_user", crash)
            with pytest.raises(RuntimeError, match="killed"):
                erase_user(backends, TENANT, USER)
        # The journal and the state went; the traces, memory and vault are still there.
        half = left_of(ERASED, scan(url))
        assert (
            "trace_runs" in half[ERASED.session]
            and "keel_state_sessions" not in half[ERASED.session]
        )
        report = erase_user(backends, TENANT, USER)
    assert report.removed["traces"]["trace_runs"] >= 2
    with sqlite3.connect(tmp_path / "keel.db") as conn:
        finished = [row[0] for row in conn.execute("SELECT finished_at FROM keel_erasures")]
    assert sorted(finished, key=lambda f: f is None)[-1] is None and len(finished) == 2
    after = scan(url)
    assert left_of(ERASED, after) == {}
    assert after.rows_with("globex:" + USER) and before.rows_with("globex:" + USER)


def test_sessions_on_redis_are_erased_with_the_rest(tmp_path: Path, redis_url: str) -> None:
    import redis

    url = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = load_settings(
        embedder="hashing:64", pii_key=MasterKey.new_key_text(), redis_url=redis_url
    )
    populate(url, settings)
    client = redis.Redis.from_url(redis_url)

    def redis_holds(needle: str) -> int:
        found = 0
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            values: list[bytes] = [key]
            if kind == b"hash":
                values += [part for pair in client.hgetall(key).items() for part in pair]
            elif kind == b"set":
                values += list(client.smembers(key))
            elif kind == b"string":
                values.append(client.get(key) or b"")
            found += sum(needle.encode() in value for value in values)
        return found

    assert redis_holds(ERASED.session) and redis_holds(ERASED.word)
    before = scan(url)
    assert "keel_state_sessions" not in before.tables  # the state is on Redis
    with Backends.open(url, settings=settings, background=False) as backends:
        report = erase_user(backends, TENANT, USER)
    assert report.removed["state"]["sessions"] == 1
    assert report.removed["state"]["checkpoints"] >= 2
    assert report.removed["state"]["leases"] == 0  # given back, as on SQL
    assert redis_holds(ERASED.session) == 0 and redis_holds(ERASED.word) == 0
    assert redis_holds(NEIGHBOURLY.session) and redis_holds(NEIGHBOURLY.word)
    assert left_of(ERASED, scan(url)) == {}
    client.close()


def test_an_erased_users_key_stops_at_once_on_the_worker_that_erased_them(
    tmp_path: Path,
) -> None:
    # The worker trusts a verified key for a while without a look-up; the erasure deleted the
    # key, so the worker that ran it must not go on serving it (and writing the user again).
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    settings = load_settings(embedder="hashing:64", pii_key=MasterKey.new_key_text())
    app, _, keys = build_service(
        url, model=ScriptedModel(_policy), tools=[book, refund], memory=True, settings=settings
    )
    operator, own_key = keys.create(TENANT), keys.create(TENANT, USER)
    turn = {"message": f"I am {ERASED.email}", "user": USER}
    mine = {"Authorization": f"Bearer {own_key}"}
    with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        first = client.post(f"/v1/sessions/{ERASED.session}/turns", json=turn, headers=mine)
        assert first.status_code == 200, first.text
        erased = client.post(
            "/v1/privacy/erase",
            json={"user_id": USER},
            headers={"Authorization": f"Bearer {operator}"},
        )
        assert erased.status_code == 200, erased.text
        again = client.post(f"/v1/sessions/{ERASED.session}/turns", json=turn, headers=mine)
        assert again.status_code == 401, again.text
    assert left_of(ERASED, scan(url)) == {}


def test_an_erased_users_records_leave_the_process_that_read_them(tmp_path: Path) -> None:
    # The records a store built from the user's rows (kept to skip validating a row read
    # again; SQLite's rows are hashable, PostgreSQL's JSON columns are not) are dropped with
    # the rows: their texts do not outlive the erasure in this process's memory.
    url, settings = _world(tmp_path)
    scope = Scope(tenant_id=TENANT, user_id=USER)
    other = Scope(tenant_id="globex", user_id=USER)
    with Backends.open(url, settings=settings, background=False) as backends:
        assert backends.memory is not None
        store = backends.memory.store
        shown = MemoryFilter()
        assert store.list_records(scope, shown) and store.list_records(other, shown)  # cached
        cached = store.records  # type: ignore[attr-defined]
        assert {r.user_id for r in cached._records.values()} == {USER}
        erase_user(backends, TENANT, USER)
        left = {(r.tenant_id, r.user_id) for r in cached._records.values()}
        assert left == {("globex", USER)}, left


def test_records_read_while_their_user_is_erased_are_not_kept_after(tmp_path: Path) -> None:
    # A read of the user's rows, made just before the erasure deleted them, builds its records
    # just after the store dropped the user's: keeping them then would outlive the erasure.
    scope = Scope(tenant_id=TENANT, user_id=USER)
    with SQLiteDatabase(tmp_path / "keel.db") as database:
        store = SQLiteMemoryStore(database)
        Memory(store, embedder=None, masker=None).add("the orchard gate is green", scope=scope)
        read, erased = threading.Event(), threading.Event()
        reader = threading.current_thread

        def run_then_wait(plan: Any, **options: Any) -> Any:
            found = SQLiteDatabase.run(database, plan, **options)
            if reader().name == "reader" and not read.is_set():
                read.set()
                erased.wait()
            return found

        database.run = run_then_wait  # type: ignore[method-assign]
        thread = threading.Thread(
            target=lambda: store.list_records(scope, MemoryFilter()), name="reader"
        )
        thread.start()
        assert read.wait(10)
        store.erase_user(TENANT, USER)
        erased.set()
        thread.join()
        left = [record.text for record in store.records._records.values()]
        assert left == [], left


def test_an_erasure_that_fails_after_deleting_the_keys_stops_them_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The keys go last but one (the audit row is finished after them): an erasure that fails
    # then has deleted them, and the worker must not go on trusting its cached copy.
    import keel.service._serve as serve

    erase_every_store = serve.aerase_user

    async def erase_then_fail(*args: Any, **options: Any) -> Any:
        await erase_every_store(*args, **options)
        raise StoreError("the audit row could not be finished")

    monkeypatch.setattr(serve, "aerase_user", erase_then_fail)
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    app, _, keys = build_service(url, model=ScriptedModel(lambda call: "Hi."), memory=False)
    operator, own_key = keys.create(TENANT), keys.create(TENANT, USER)
    turn = {"message": "hello", "user": USER}
    mine = {"Authorization": f"Bearer {own_key}"}
    with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        first = client.post(f"/v1/sessions/{ERASED.session}/turns", json=turn, headers=mine)
        assert first.status_code == 200, first.text
        erased = client.post(
            "/v1/privacy/erase",
            json={"user_id": USER},
            headers={"Authorization": f"Bearer {operator}"},
        )
        assert erased.status_code >= 500, erased.text
        again = client.post(f"/v1/sessions/{ERASED.session}/turns", json=turn, headers=mine)
        assert again.status_code == 401, again.text
