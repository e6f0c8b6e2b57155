"""The PII master key: how it is given, and what a wrong or malformed one does."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import pytest

from keel.errors import ConfigError, VaultKeyError
from keel.privacy import MasterKey, key_provider_from_env


def test_a_key_is_read_as_url_safe_base64_standard_base64_or_hex() -> None:
    raw = secrets.token_bytes(32)
    texts = [
        base64.urlsafe_b64encode(raw).decode(),
        base64.standard_b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
        f"  {raw.hex()}\n",
    ]
    ids = {MasterKey.from_text(text).key_id for text in texts}
    assert ids == {MasterKey(raw).key_id}


@pytest.mark.parametrize("text", ["", "short", "A" * 43 + "!", "00" * 31, "00" * 33])
def test_a_malformed_key_is_a_typed_error_that_never_repeats_the_text(text: str) -> None:
    with pytest.raises(VaultKeyError) as raised:
        MasterKey.from_text(text, source="KEEL_PII_KEY")
    assert "KEEL_PII_KEY" in str(raised.value)
    if len(text) > 4:
        assert text.strip() not in str(raised.value)
    assert isinstance(raised.value, ConfigError)


def test_a_data_key_unwraps_only_under_its_master_key_and_its_owner() -> None:
    key, other = MasterKey.generate(), MasterKey.generate()
    data_key = secrets.token_bytes(32)
    wrapped = key.wrap(data_key, b'["acme", "alice"]')
    assert key.unwrap(wrapped, b'["acme", "alice"]') == data_key
    with pytest.raises(VaultKeyError):
        other.unwrap(wrapped, b'["acme", "alice"]')
    # A wrapped key copied to another user's row does not open.
    with pytest.raises(VaultKeyError):
        key.unwrap(wrapped, b'["acme", "bob"]')
    # Two wraps of one key differ (a fresh nonce each time).
    assert key.wrap(data_key, b"x") != key.wrap(data_key, b"x")


def test_the_key_id_names_the_key_without_revealing_it() -> None:
    raw = secrets.token_bytes(32)
    key = MasterKey(raw)
    assert key.key_id == MasterKey(raw).key_id != MasterKey.generate().key_id
    assert raw.hex()[:16] not in key.key_id
    assert raw.hex() not in repr(key)


def test_the_environment_gives_the_key_or_says_exactly_what_is_wrong(tmp_path: Path) -> None:
    assert key_provider_from_env({}) is None
    text = MasterKey.new_key_text()
    from_env = key_provider_from_env({"KEEL_PII_KEY": text})
    assert from_env is not None and from_env.key_id == MasterKey.from_text(text).key_id
    key_file = tmp_path / "pii.key"
    key_file.write_text(text + "\n")
    key_file.chmod(0o600)
    from_file = key_provider_from_env({"KEEL_PII_KEY_FILE": str(key_file)})
    assert from_file is not None and from_file.key_id == from_env.key_id
    with pytest.raises(VaultKeyError, match="KEEL_PII_KEY is set but empty"):
        key_provider_from_env({"KEEL_PII_KEY": ""})
    with pytest.raises(VaultKeyError, match="cannot read the PII key file"):
        key_provider_from_env({"KEEL_PII_KEY_FILE": str(tmp_path / "missing.key")})
    with pytest.raises(VaultKeyError, match="not a 32-byte key"):
        key_provider_from_env({"KEEL_PII_KEY": "not a key"})


def test_a_binary_key_file_is_refused_without_a_byte_of_it_in_the_message(tmp_path: Path) -> None:
    raw = bytes([0x41, 0xE9, 0x9C, 0xFF]) + secrets.token_bytes(28)
    key_file = tmp_path / "binary.key"
    key_file.write_bytes(raw)
    key_file.chmod(0o600)
    with pytest.raises(VaultKeyError) as raised:
        MasterKey.from_file(key_file)
    message = str(raised.value)
    assert "not text" in message and "binary.key" in message
    # No byte of the key, in any spelling a decoder or repr would give it.
    shown = [f"0x{byte:02x}" for byte in raw] + [f"\\x{byte:02x}" for byte in raw]
    assert [spelling for spelling in shown if spelling in message] == []
    assert raised.value.__cause__ is None and raised.value.__context__ is not None


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_key_file_open_to_others_is_refused_with_chmod_600(tmp_path: Path, mode: int) -> None:
    key_file = tmp_path / "pii.key"
    text = MasterKey.new_key_text()
    key_file.write_text(text)
    key_file.chmod(mode)
    with pytest.raises(VaultKeyError, match="chmod 600") as raised:
        MasterKey.from_file(key_file)
    assert text not in str(raised.value)
    key_file.chmod(0o600)
    assert MasterKey.from_file(key_file).key_id == MasterKey.from_text(text).key_id
    key_file.chmod(0o400)
    assert MasterKey.from_file(key_file).key_id == MasterKey.from_text(text).key_id
