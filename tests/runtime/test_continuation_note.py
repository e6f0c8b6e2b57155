"""keel's request to continue a cut answer is keel's words: a model that echoes it back never
has it shown (in the reply, the streamed text or the history) as its own (issue 45, item 5)."""

from __future__ import annotations

import pytest

from keel.messages import Message, Usage
from keel.models import Completion
from keel.runtime import TextDelta
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent

_NOTE = (
    "Your previous reply was cut off at the token limit. Continue it exactly where it stopped, "
    "mid-word if it stopped mid-word: do not repeat what you wrote, do not start over, and do "
    "not mention the cut."
)


def _cut(text: str) -> Completion:
    return Completion(
        message=Message.assistant(text),
        finish_reason="length",
        usage=Usage(prompt_tokens=20, completion_tokens=8),
        model="scripted",
        latency_ms=1.0,
    )


def _echoing_model(echo: str, chunk_chars: int) -> ScriptedModel:
    """A model whose answer is cut, and whose continuation starts by repeating keel's note."""
    return ScriptedModel(
        [_cut("Once upon a time, a fox "), f"{echo}\n\nlived in a quiet wood."],
        stream_chunk_chars=chunk_chars,
    )


@pytest.mark.parametrize("chunk_chars", [1, 7, 400])
@pytest.mark.parametrize(
    "echo", [_NOTE, _NOTE.split(". ")[0] + "."], ids=["whole-note", "first-sentence"]
)
async def test_an_echoed_continuation_note_is_never_the_models_visible_words(
    database: SQLiteDatabase, echo: str, chunk_chars: int
) -> None:
    agent = sqlite_agent(database, _echoing_model(echo, chunk_chars))
    events = [event async for event in agent.stream("Tell a story.", session="s1", user="u1")]
    streamed = "".join(event.text for event in events if isinstance(event, TextDelta))
    assert "cut off" not in streamed, streamed
    assert streamed == "Once upon a time, a fox lived in a quiet wood."
    state = agent.session_state("s1")
    assert state is not None
    assert [m.content for m in state.messages if m.role == "assistant"] == [
        "Once upon a time, a fox lived in a quiet wood."
    ]


async def test_a_run_reply_leaves_the_echoed_note_out(database: SQLiteDatabase) -> None:
    agent = sqlite_agent(database, _echoing_model(_NOTE, 4))
    reply = await agent.run("Tell a story.", session="s1", user="u1")
    assert reply.status == "completed" and reply.error is None
    assert "cut off" not in reply.text and "Continue it exactly" not in reply.text
    assert reply.text == "Once upon a time, a fox lived in a quiet wood."
