"""``keel state history`` with a session id a person mistyped, or typed without its tenant (the
store's keys are ``tenant/session``): the error names the sessions they may have meant."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli import keel_process


def _error_line(*args: str) -> str:
    result = keel_process("state", "history", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return " ".join(lines[0].split())


def test_a_mistyped_session_gets_the_near_names_suggested() -> None:
    for session in ("support-ada", "support-bob", "ada"):
        chat = keel_process(
            "chat", "--no-memory", "-m", "scripted:echo", "--session", session, stdin="hi\n"
        )
        assert chat.returncode == 0, chat.stderr
    assert keel_process("state", "history", "default/support-ada").returncode == 0
    # A letter off: the session it nearly spells, first.
    said = _error_line("default/suport-ada")
    assert "no state stored for session 'default/suport-ada'; did you mean " in said, said
    assert said.partition("did you mean ")[2].startswith("'default/support-ada'"), said
    # Without the tenant: the same session in its tenant (too short a name for difflib to
    # find it in the whole key).
    said = _error_line("ada")
    assert "did you mean 'default/ada'" in said, said
    # Nothing near: where the names are.
    said = _error_line("zzz")
    assert "did you mean" not in said and "keel state sessions lists them" in said, said


def test_the_state_commands_read_the_state_where_the_deployment_keeps_it(
    redis_url: str, tmp_path: Path
) -> None:
    """With ``KEEL_REDIS_URL`` set the agents keep their state on Redis, but ``keel state``
    read the SQL database's: no sessions, and "no state stored" for a session that had one."""
    env = {"KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}", "KEEL_REDIS_URL": redis_url}
    chat = keel_process(
        "chat", "--no-memory", "-m", "scripted:echo", "--session", "s1", "--create",
        stdin="hi\n", env=env,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    listed = keel_process("state", "sessions", "--json", env=env)
    assert json.loads(listed.stdout.strip().splitlines()[-1]) == {"sessions": ["default/s1"]}
