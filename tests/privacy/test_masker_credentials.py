"""A credential has no shape of its own: it is the value after "password:", "DB_PASSWORD=",
'"api_key": "..."', "Authorization: Basic", "my PIN is", or the password of a URL. Each is
masked (the label kept) by the masker every store writes through, not only by the traces'
redactor, so a password a user types, a tool returns or a model repeats reaches no table; and
what only looks like one (a call, a variable, null, a word) stays as written."""

from __future__ import annotations

import json

import pytest

from keel.messages import Message
from keel.privacy import PIIMasker, StreamMasker
from keel.privacy._detectors import _OPEN_QUOTED_SECRET, open_quoted_secret
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from keel.tracing._redact import redact_pii
from tests.privacy._samples import dump_sqlite, fed_in_pieces

MASKED = [
    ("my db password: hunter2!", "my db password: <SECRET_1>"),
    ("export DB_PASSWORD=Tr0ub4dor&3 && run", "export DB_PASSWORD=<SECRET_1> && run"),
    ('{"user": "ops", "password": "correct horse"}', '{"user": "ops", "password": "<SECRET_1>"}'),
    ("pwd='abc' client_secret => 'Qw3rty99'", "pwd='<SECRET_1>' client_secret => '<SECRET_2>'"),
    ("spring.datasource.password=S3cr3t!", "spring.datasource.password=<SECRET_1>"),
    (
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "aws_secret_access_key = <SECRET_1>",
    ),
    ("postgres://admin:s3cretP@ss@db.example.com:5432/app", "postgres://admin:<SECRET_1>@"),
    ("redis://:p4ss@localhost:6379/0", "redis://:<SECRET_1>@localhost:6379/0"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic <SECRET_1>"),
    ("my password is Zx9!qLmP, ok?", "my password is <SECRET_1>, ok?"),
    ("the PIN was 4821.", "the PIN was <SECRET_1>."),
    # A key of a known shape keeps its own type.
    ("OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwxyz0123", "OPENAI_API_KEY=<API_KEY_1>"),
]

KEPT = [
    "Click the link to reset your password: it expires in an hour.",
    "password = get_password()",
    'secret = os.environ["APP_SECRET"]',
    "use $DB_PASSWORD or {{ vault_password }}",
    '{"api_key": null, "token": "<SECRET_1>", "password": "********"}',
    "my password is incorrect, says the login page",
    "set max_tokens=512 and passwords: 3 attempts; monkey: banana",
    "https://example.com:8080/docs?page=2",
]


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_a_credential_is_masked_and_its_label_kept(text: str, masked: str) -> None:
    result = PIIMasker().mask(text)
    assert result.text.startswith(masked), result.text
    assert result.text == PIIMasker().mask(result.text).text  # masking twice changes nothing


@pytest.mark.parametrize("text", KEPT)
def test_what_only_looks_like_a_credential_is_kept(text: str) -> None:
    assert PIIMasker().mask_text(text) == text


def test_a_traced_credential_keeps_the_vaults_placeholder() -> None:
    assert redact_pii('password: hunter2! "api_key": "abcdef"') == (
        'password: <SECRET_1> "api_key": "<SECRET_2>"'
    )


SECRETS = ["hunter2!", "s3cretP", "Tr0ub4dor&3", "dXNlcjpwYXNzd29yZA", "Zx9!qLmP"]


@tool
def database_settings(service: str) -> str:
    """The connection settings of a service."""
    return json.dumps({"url": "postgres://app:s3cretP@ss@db.internal:5432/app", "pool": 5})


def _policy(call: ScriptedCall) -> Message | str:
    if not any(m.role == "tool" for m in call.messages):
        return ScriptedModel.tool_call("database_settings", json.dumps({"service": "billing"}))
    return "Done. Keep DB_PASSWORD=Tr0ub4dor&3 and Authorization: Basic dXNlcjpwYXNzd29yZA== safe."


@pytest.mark.parametrize("vault", ["on", "off"])
async def test_no_table_holds_a_credential_a_user_a_tool_or_the_model_wrote(
    vault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", vault)
    agent = Agent.embedded(
        ScriptedModel(_policy), system_prompt="s", tools=[database_settings], memory=True
    )
    try:
        reply = await agent.handle(
            "s1", "u1", "my db password: hunter2! and my password is Zx9!qLmP, set billing up"
        )
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    path = load_settings().sqlite_path
    assert path is not None
    dumped = dump_sqlite(path)
    assert dumped.get("keel_state_checkpoints") and dumped.get("memory_records")
    assert dumped.get("trace_steps") and dumped.get("trace_runs")
    found = {secret: [t for t, text in dumped.items() if secret in text] for secret in SECRETS}
    assert found == {secret: [] for secret in SECRETS}
    assert "<SECRET_" in dumped["keel_state_checkpoints"]


STREAMED = [
    '{"user": "ops", "password": "correct horse battery staple", "port": 5432}',
    "Here: DB_PASSWORD=Tr0ub4dor&3 and my password is Zx9!qLmP, then postgres://a:s3cret@db/x ok",
    "pwd = 'a long pass phrase with spaces in it that runs past the hold of a stream' done",
]


@pytest.mark.parametrize("by_word", [True, False])
@pytest.mark.parametrize("text", STREAMED)
def test_a_streamed_credential_is_never_shown_in_part(text: str, by_word: bool) -> None:
    """A quoted value may hold spaces: the stream holds it back until its quote closes, so
    what is shown, piece by piece, is the masked whole."""
    whole = PIIMasker().mask_text(text)
    assert "<SECRET_" in whole
    for cuts in ([1], [3], [2, 5, 1, 7], [11]):
        stream = StreamMasker(PIIMasker().mask_text, by_word=by_word)
        assert fed_in_pieces(stream, text, cuts) == whole, cuts


def test_the_open_quote_check_is_its_pattern_behind_a_cheap_gate() -> None:
    """Looked for at every piece a stream receives, so gated by str operations: never a
    different answer from the pattern alone, at any cut of any of these texts."""

    def by_the_pattern(folded: str) -> int | None:
        found = _OPEN_QUOTED_SECRET.search(folded, max(0, len(folded) - 320))
        if found is None:
            return None
        return max(folded.rfind('"', found.start()), folded.rfind("'", found.start())) + 1

    texts = [*STREAMED, *KEPT, *(text for text, _ in MASKED), "x" * 400 + ' "token": "ab c']
    for text in texts:
        for cut in range(len(text) + 1):
            assert open_quoted_secret(text[:cut]) == by_the_pattern(text[:cut]), text[:cut]
    assert open_quoted_secret('{"password": "correct horse') == len('{"password": "')
