from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.tracing import redact_json, redact_secrets

SECRETS = {
    "openai": "sk-proj-T3BlbkFJx9QwErTyUiOpAsDfGh",
    "openai_classic": "sk-abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGH",
    "anthropic": "sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "github": "ghp_1234567890abcdefghijABCDEFGHIJ123456",
    "github_pat": "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
    "slack": "xoxb-1234567890-abcdefghijkl",
    "google": "AIzaSyA1234567890abcdefghijklmnopqrstu",
    "jwt": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4",
    "email": "first.last+tag@mail.example.co.uk",
}


@pytest.mark.parametrize("kind", sorted(SECRETS))
def test_each_kind_of_secret_is_masked_in_context(kind: str) -> None:
    secret = SECRETS[kind]
    text = f"before {secret} after"
    masked = redact_secrets(text)
    assert secret not in masked
    assert masked.startswith("before ") and masked.endswith(" after")
    assert "[REDACTED:" in masked
    assert redact_secrets(masked) == masked  # idempotent


def test_credentials_in_headers_and_assignments() -> None:
    text = (
        "Authorization: Bearer abc123def456ghi\n"
        "authorization=Basic dXNlcjpwYXNzd29yZA==\n"
        'password = "correct horse", {"api_key": "k-12345678"} client_secret: s3cr3tvalue\n'
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----"
    )
    masked = redact_secrets(text)
    for leaked in ("abc123def456ghi", "dXNlcjpwYXNzd29yZA", "k-12345678", "s3cr3tvalue", "MIIEow"):
        assert leaked not in masked, leaked
    assert "correct" not in masked and "horse" not in masked
    assert '{"api_key": "[REDACTED:secret]"}' in masked  # JSON stays JSON
    assert "Authorization: Bearer [REDACTED:credential]" in masked


def test_card_numbers_only_when_luhn_valid() -> None:
    masked = redact_secrets(
        "card 4111 1111 1111 1111, order 1234567890123, ref 4111-1111-1111-1112"
    )
    assert "4111 1111 1111 1111" not in masked
    assert "1234567890123" in masked and "4111-1111-1111-1112" in masked


def test_ordinary_text_is_left_alone() -> None:
    text = (
        "Book 2 seats on TP123 from LIS to OSL on 2026-12-01; basic economy; "
        "the prompt used 1200 tokens; token budget 512; skip-list; task-id sk-1"
    )
    assert redact_secrets(text) == text
    assert redact_secrets("") == ""


def test_json_values_are_redacted_recursively() -> None:
    value = {
        "user": {"email": SECRETS["email"], "keys": [SECRETS["aws"], 3, None, True]},
        SECRETS["email"]: "keyed by address",
        "n": 1.5,
    }
    masked = redact_json(value, redact_secrets)
    flat = repr(masked)
    assert SECRETS["email"] not in flat and SECRETS["aws"] not in flat
    assert masked["n"] == 1.5 and masked["user"]["keys"][1:] == [3, None, True]


_SEPARATORS = st.sampled_from([" ", "\n", '"', "'", ":", "=", ",", "(", ")", "[", "]", "{", "}"])
_WORDS = st.text(alphabet="abcdefghij KLMNOP 0123.,!?\n", max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(sorted(SECRETS)),
    before=_WORDS,
    after=_WORDS,
    left=_SEPARATORS,
    right=_SEPARATORS,
)
def test_no_secret_survives_in_any_surrounding_text(
    kind: str, before: str, after: str, left: str, right: str
) -> None:
    secret = SECRETS[kind]
    text = f"{before}{left}{secret}{right}{after}"
    masked = redact_secrets(text)
    assert secret not in masked
    assert redact_secrets(masked) == masked
