"""``Backends.open`` opens the PII vault on the SQL database when it is given a master key."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import VaultKeyError
from keel.privacy import MasterKey
from keel.settings import load_settings
from keel.stores import (
    Backends,
    RedisStateBackend,
    SQLiteDatabase,
    SQLiteVaultStore,
    SQLVaultStore,
)
from tests.runtime.test_agent_open import _connections_drain


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


def _open_files(path: Path) -> list[str]:
    """This process's open descriptors on the database file (and its WAL and shm)."""
    fds = Path("/proc/self/fd")
    targets = [str(fd.readlink()) for fd in fds.iterdir() if fd.is_symlink()]
    return [target for target in targets if target.startswith(str(path))]


def _sealed_round_trip(backends: Backends) -> None:
    assert backends.vault is not None
    placeholder = backends.vault.user("acme", "alice").placeholder("EMAIL", "alice@example.com")
    assert placeholder == "<EMAIL_1>"
    # Another view, as another turn would take: it reads the value back from the store.
    assert backends.vault.user("acme", "alice").values([placeholder]) == {
        placeholder: "alice@example.com"
    }


def test_opting_out_no_vault(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, pii_vault=False)
    with Backends.open(settings, memory=False) as backends:
        assert backends.vault is None


def test_an_explicit_key_opens_the_vault_in_the_same_database(tmp_path: Path) -> None:
    key = MasterKey.generate()
    with Backends.open(load_settings(data_dir=tmp_path), memory=False, pii_key=key) as backends:
        assert backends.vault is not None and backends.vault.keys is key
        store = backends.vault.store
        assert isinstance(store, SQLiteVaultStore) and store.db is backends.sql
        _sealed_round_trip(backends)
        assert backends.sql.schema_versions()["vault"] == 2


def test_the_key_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = MasterKey.new_key_text()
    monkeypatch.setenv("KEEL_PII_KEY", text)
    with Backends.open(load_settings(data_dir=tmp_path), memory=False) as backends:
        _sealed_round_trip(backends)
        assert backends.vault is not None
        assert backends.vault.keys.key_id == MasterKey.from_text(text).key_id


def test_the_key_comes_from_a_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "pii.key"
    key_file.write_text(MasterKey.new_key_text() + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("KEEL_PII_KEY_FILE", str(key_file))
    with Backends.open(load_settings(data_dir=tmp_path), memory=False) as backends:
        _sealed_round_trip(backends)
    # The same file opens the same vault again.
    with Backends.open(load_settings(data_dir=tmp_path), memory=False) as backends:
        assert backends.vault is not None
        assert backends.vault.user("acme", "alice").resolve("<EMAIL_1>") == "alice@example.com"


def test_the_key_setting_is_never_shown(tmp_path: Path) -> None:
    text = MasterKey.new_key_text()
    settings = load_settings(data_dir=tmp_path, pii_key=text)
    for shown in (repr(settings), str(settings), settings.model_dump_json()):
        assert text not in shown


@pytest.mark.parametrize(
    "overrides",
    [
        {"pii_key": "not a key"},
        {"pii_key": ""},
        {"pii_key": MasterKey.new_key_text()[:20]},
        {"pii_key_file": "missing.key"},
    ],
    ids=["malformed", "empty", "short", "missing-file"],
)
def test_an_unusable_key_is_refused_before_anything_opens(
    tmp_path: Path, overrides: dict[str, str]
) -> None:
    settings = load_settings(data_dir=tmp_path, **overrides)
    with pytest.raises(VaultKeyError):
        Backends.open(settings, memory=False)
    assert not (tmp_path / "keel.db").exists()


def test_a_wrong_key_is_refused_and_nothing_is_left_open(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with Backends.open(settings, pii_key=MasterKey.generate()) as backends:
        _sealed_round_trip(backends)
    path = tmp_path / "keel.db"
    assert _open_files(path) == []
    with pytest.raises(VaultKeyError, match="not this vault's"):
        Backends.open(settings, pii_key=MasterKey.generate())
    assert _open_files(path) == []


def test_state_on_redis_keeps_the_vault_on_the_sql_database(tmp_path: Path, redis_url: str) -> None:
    settings = load_settings(data_dir=tmp_path, redis_url=redis_url)
    with Backends.open(settings, memory=False, pii_key=MasterKey.generate()) as backends:
        assert isinstance(backends.state.backend, RedisStateBackend)
        assert backends.vault is not None
        assert isinstance(backends.sql, SQLiteDatabase)
        _sealed_round_trip(backends)


@pytest.mark.postgres
def test_postgres_opens_the_vault_and_refuses_a_wrong_key(postgres_url: str) -> None:
    settings = load_settings(database=postgres_url)
    with Backends.open(settings, memory=False, pii_key=MasterKey.generate()) as backends:
        store = backends.vault and backends.vault.store
        assert isinstance(store, SQLVaultStore) and not isinstance(store, SQLiteVaultStore)
        assert store.db is backends.sql
        _sealed_round_trip(backends)
    with pytest.raises(VaultKeyError, match="not this vault's"):
        Backends.open(settings, memory=False, pii_key=MasterKey.generate())
    # Client sessions only, waited out: autovacuum's workers and a closed client's server
    # process on its way out are not connections the refused open left behind.
    assert _connections_drain(postgres_url)
