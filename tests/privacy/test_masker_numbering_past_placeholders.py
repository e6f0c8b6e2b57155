"""Placeholders numbered per text (no vault) skip the ones the text already holds: a text
masked before and written again with a new value ("<EMAIL_1> and carol@...", a model's reply
quoting what it was shown) would otherwise give the new value the old one's placeholder, and
the model would read two people as one."""

from __future__ import annotations

from pathlib import Path

from keel import Agent
from keel.privacy import PIIMasker, StreamMasker
from keel.settings import load_settings
from keel.testing import ScriptedModel


def test_a_new_value_is_numbered_past_the_placeholders_the_text_holds() -> None:
    masker = PIIMasker()
    text = "<EMAIL_1> wrote to carol@example.com and <EMAIL_3>; call <PHONE_1> or +1 415 555 0132"
    assert masker.mask_text(text) == (
        "<EMAIL_1> wrote to <EMAIL_2> and <EMAIL_3>; call <PHONE_1> or <PHONE_2>"
    )
    assert masker.mask_text("dave@example.com, <EMAIL_2>, erin@example.com, dave@example.com") == (
        "<EMAIL_1>, <EMAIL_2>, <EMAIL_3>, <EMAIL_1>"
    )
    # A name that only looks like an entity's counts too, and nothing else changes.
    assert masker.mask_text("<CREDIT_CARD_1> then 4111 1111 1111 1111") == (
        "<CREDIT_CARD_1> then <CREDIT_CARD_2>"
    )
    assert masker.mask_text("mail bob@example.com") == "mail <EMAIL_1>"


def test_a_stream_numbers_as_the_whole_text_does() -> None:
    masker = PIIMasker()
    text = "Earlier you saw <EMAIL_1>. " + "The new contact is carol@example.com, ok. " * 4
    whole = masker.mask_text(text)
    assert "<EMAIL_2>" in whole and "carol" not in whole
    stream = StreamMasker(masker.mask_text, spans=masker.mask_spans)
    shown = "".join(stream.feed(text[i : i + 5]) for i in range(0, len(text), 5))
    assert shown + stream.finish() == whole


async def test_an_agent_without_a_vault_keeps_two_people_two_in_the_reply(tmp_path: Path) -> None:
    # The model quotes a placeholder it was shown and writes a new address beside it.
    model = ScriptedModel(lambda call: "I wrote to <EMAIL_1> and to carol@example.com.")
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64", pii_vault=False)
    agent = Agent.open(None, settings=settings, model=model, system_prompt="You write mail.")
    try:
        reply = await agent.handle("s1", "u1", "Write to both.")
        state = agent.session_state("s1")
    finally:
        await agent.aclose()
    assert reply.text == "I wrote to <EMAIL_1> and to <EMAIL_2>.", reply.text
    assert state is not None
    assert state.messages[-1].content == "I wrote to <EMAIL_1> and to <EMAIL_2>.", state
