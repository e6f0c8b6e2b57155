"""A turn's id in its run's trace: keel's own id (a uuid4's hex) kept whole, a caller's redacted
as any text (fast65). The masker read a run of a hex id's digits as a payment card about once
in 5,000 ids (until a card's digits glued to a letter were no card); masked so, the id no
longer matched, and a run killed mid-turn was never marked as taken over by the run that
finished its turn."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from keel.privacy import PIIMasker
from keel.runtime import Agent, _commit
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tracing import Run, RunQuery
from keel.tracing._redact import OwnId, redact_attributes

CARD_LIKE = "2798383905384b3dae841a211e3c0c6b"
"""A uuid4 hex whose first 13 digits pass the Luhn check: once masked as a card in any text."""


class _Killed(BaseException):
    """The worker dies in the middle of a model call (nothing of the turn catches it)."""


def _agent(directory: Path, model: ScriptedModel) -> Agent:
    return Agent.open(
        None,
        settings=load_settings(data_dir=directory / "keel", embedder="hashing:256"),
        model=model,
        system_prompt="You help.",
        memory=False,
    )


def _runs(agent: Agent) -> list[Run]:
    store = agent.tracer.store
    assert store is not None
    return sorted(store.list_runs(RunQuery(session_id="s1")), key=lambda run: run.started_at)


def test_the_id_no_longer_reads_as_a_card_to_the_masker() -> None:
    assert PIIMasker().mask_text(CARD_LIKE) == CARD_LIKE
    assert PIIMasker().mask_text(CARD_LIKE[:13]) != CARD_LIKE[:13]  # its digits alone: a card


async def test_a_turn_id_keel_made_is_kept_whole_and_its_killed_run_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = itertools.chain([uuid.UUID(CARD_LIKE)], iter(uuid.uuid4, None))
    monkeypatch.setattr(_commit, "uuid", SimpleNamespace(uuid4=lambda: next(ids)))
    killed = True

    def policy(call: ScriptedCall) -> str:
        if killed:
            raise _Killed
        return "done"

    agent = _agent(tmp_path, ScriptedModel(policy))
    try:
        with pytest.raises(_Killed):
            await agent.handle("s1", "u1", "hello")
        killed = False
        reply = await agent.handle("s1", "u1", "again")
        assert reply.interrupted_turn is not None
        first, finishing, own = _runs(agent)
    finally:
        await agent.aclose()
    # The run that finished the turn found the killed one by its id.
    assert first.status == "interrupted", first.status
    assert first.error_message is not None and "took its turn over" in first.error_message
    assert first.attributes["turn_id"] == CARD_LIKE
    assert finishing.attributes["turn_id"] == CARD_LIKE
    assert own.attributes["turn_id"] != CARD_LIKE and own.status == "succeeded"


async def test_a_callers_turn_id_is_redacted_as_before(tmp_path: Path) -> None:
    agent = _agent(tmp_path, ScriptedModel(lambda call: "done"))
    try:
        await agent.run("hello", session="s1", user="u1", turn_id="ask bob@example.com")
        await agent.run("again", session="s1", user="u1", turn_id="card 4111111111111111")
        mail, card = _runs(agent)
    finally:
        await agent.aclose()
    assert "bob@example.com" not in str(mail.attributes)
    assert mail.attributes["turn_id"].startswith("ask <EMAIL_")
    assert card.attributes["turn_id"].startswith("card <CREDIT_CARD_")


def test_only_an_own_id_of_a_uuid_hex_skips_redaction() -> None:
    def redact(value: object) -> object:
        assert isinstance(value, dict)
        return dict.fromkeys(value, "<REDACTED>")

    attributes = {
        "resumed": False,
        "turn_id": OwnId(CARD_LIKE),
        "not_hex": OwnId("bob@example.com"),
        "short": OwnId(CARD_LIKE[:-1]),
    }
    assert redact_attributes(attributes, redact) == {
        "resumed": "<REDACTED>",
        "not_hex": "<REDACTED>",
        "short": "<REDACTED>",
        "turn_id": CARD_LIKE,
    }
    kept = redact_attributes(attributes, redact)["turn_id"]
    assert type(kept) is str
    assert redact_attributes({"turn_id": CARD_LIKE}, redact) == {"turn_id": "<REDACTED>"}
