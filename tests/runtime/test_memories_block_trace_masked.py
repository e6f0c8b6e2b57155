"""The memories block a turn's prompt shows is masked in the trace, whatever its records hold:
records stored unmasked (by a memory with no masker: an import, or a policy that masked less
when they were written) are recalled raw into the prompt, and the trace of each turn that
shows them holds placeholders. A value inside one record, and one that runs from one recalled
record to the next (a bearer token on the turn after the "Bearer" that introduces it, a
private key over three turns), never reaches the trace store raw: not the first time the
block is masked whole, nor later, when the masker knows most of its lines from earlier turns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from keel.context._engine import MEMORIES_HEADING
from keel.memory import Memory, Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from tests.privacy._samples import dump_sqlite

TOKEN = "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2Lk"
KEY_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"
EMAIL = "mallory.x7q@example.org"


def _fillers(first: int) -> list[tuple[int, str]]:
    """Turns of the earlier session that make the block long (lines met at every turn)."""
    return [
        (first + n, f"User: the zebra crossing by shelf {first + n} was repainted in spring.")
        for n in range(8)
    ]


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    prompts: list[list[Message]] = []

    def policy(call: ScriptedCall) -> str:
        prompts.append(list(call.messages))
        return "Noted."

    built = Agent.embedded(ScriptedModel(policy), system_prompt="You help.", memory=True)
    built.prompts = prompts  # type: ignore[attr-defined]
    yield built  # the test closes it, to read the file


def _raw_memory(agent: Agent) -> Memory:
    """A memory on the agent's store that masks nothing (records written before masking)."""
    assert agent.memory is not None
    return Memory(agent.memory.store, embedder=agent.memory.embedder, masker=None)


async def _recalled(agent: Agent, user: str, steps: list[list[tuple[int, str]]]) -> str:
    """Write each step's turns of ``user``'s earlier session, then a turn that recalls them;
    the last prompt's memories block."""
    raw = _raw_memory(agent)
    scope = Scope(tenant_id=agent.tenant_id, user_id=user)
    for turns in steps:
        for turn, text in turns:
            raw.add(text, scope=scope, kind="episodic", type="turn", session_id="old", turn=turn)
        raw.flush()
        await agent.handle(f"now-{user}", user, "the zebra header, key and address, please")
    return _block(agent)


def _traces(agent: Agent) -> str:
    path = load_settings().sqlite_path
    assert path is not None
    dumped = dump_sqlite(path)
    assert dumped.get("trace_steps"), "no step was traced"
    return "\n".join(text for table, text in dumped.items() if table.startswith("trace"))


def _block(agent: Agent) -> str:
    prompt = agent.prompts[-1]  # type: ignore[attr-defined]
    return next(m.content for m in prompt if m.role == "system" and MEMORIES_HEADING in m.content)


async def test_values_in_and_across_recalled_records_never_reach_the_trace(agent: Agent) -> None:
    # One user each (each recall its own), the masker's lines shared. A record's turn is
    # written after the one it continues, so its lines are met (clean on their own) before
    # the line that makes them a value: the token before "Bearer", the key's body before its
    # BEGIN line, and that before its END line.
    try:
        mailed = await _recalled(agent, "cy", [_fillers(10), [(20, f"write to {EMAIL} (zebra)")]])
        assert EMAIL in mailed
        keyed = await _recalled(
            agent,
            "bob",
            [
                [*_fillers(10), (31, KEY_BODY)],
                [(30, "User: zebra key -----BEGIN PRIVATE KEY-----")],
                [(32, "-----END PRIVATE KEY----- is the zebra key")],
            ],
        )
        assert f"-----BEGIN PRIVATE KEY-----\n{KEY_BODY}\n-----END" in keyed
        headed = await _recalled(
            agent,
            "ada",
            [
                [*_fillers(10), (2, f"{TOKEN} zebra")],
                [(1, "User: my zebra header is Authorization: Bearer")],
            ],
        )
        # Recalled raw into the prompt, as stored, neighbouring turns on neighbouring lines.
        assert f"Bearer\n{TOKEN}" in headed
        assert min(len(mailed), len(keyed), len(headed)) > 512
    finally:
        await agent.aclose()
    traced = _traces(agent)
    # The token alone is no value (the first turn's trace holds it), nor the key's body
    # before its END line is recalled: after "Bearer", between BEGIN and END, they are.
    assert "Authorization: Bearer\\n<BEARER_TOKEN_" in traced  # JSON: the line break escaped
    assert f"Bearer\\n{TOKEN}" not in traced
    assert "zebra key <PRIVATE_KEY_" in traced
    assert f"{KEY_BODY}\\n-----END" not in traced
    assert EMAIL not in traced


async def test_a_key_whose_begin_line_holds_a_no_break_space_never_reaches_the_trace(
    agent: Agent,
) -> None:
    # The detectors read "-----BEGIN\u00a0PRIVATE KEY-----" as a BEGIN line (a no-break space
    # folds to a space): the line is met first with no END line after it, then the key's body
    # and END line are recalled beneath it.
    try:
        keyed = await _recalled(
            agent,
            "bob",
            [
                [
                    *_fillers(10),
                    (29, "User: here is my zebra key"),
                    (30, "-----BEGIN\u00a0PRIVATE KEY-----"),
                ],
                [(31, KEY_BODY), (32, "-----END PRIVATE KEY----- is the zebra key")],
            ],
        )
        assert f"-----BEGIN\u00a0PRIVATE KEY-----\n{KEY_BODY}\n-----END" in keyed
        assert len(keyed) > 512
    finally:
        await agent.aclose()
    traced = _traces(agent)
    assert KEY_BODY not in traced
    assert "<PRIVATE_KEY_" in traced


async def test_a_bare_number_beside_an_empty_id_list_is_masked_in_the_trace(agent: Agent) -> None:
    # '"item_ids": []' labels no number as an id: the bare number after it is a phone number.
    raised: Exception | None = None
    try:
        await agent.handle("s", "ann", 'my order {"item_ids": [], "ref": "4155550132"}')
    except Exception as error:  # the masker's own TypeError, once
        raised = error
    finally:
        await agent.aclose()
    assert raised is None, f"the turn raised {raised!r}"
    traced = _traces(agent)
    assert "4155550132" not in traced
    assert "<PHONE_" in traced
