"""Folding turns into the running summary costs what is new, not the summary: counted, not timed.

A session whose summary cap is large beside its window folds its oldest turn into the summary
at nearly every turn, and the summary grows by a few lines a turn. What is counted is the
characters the agent's tokenizer reads in a turn, and the characters of summary lines the
extractive summarizer normalizes (reads to find repeats). Reading the whole summary again at
each fold (parsing and normalizing every line, tokenizing it whole to check the cap, again to
record its size, again for the prompt's block) costs a few hundred more characters every turn;
extending the last summary and counting its lines once costs as much at turn 30 as at turn 12.
"""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from pathlib import Path

import pytest

import keel.context._summarize as summarize_module
from keel.context import ContextBudget
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from tests.runtime.test_turn_cost_flat import lookup


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here is what the records say about it."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-12:]}))


async def test_a_turn_reads_as_much_of_the_summary_at_turn_30_as_at_12(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ScriptedModel(_policy, keep_calls=0)
    tokenizer = model.counter.tokenizer
    read = {"tokenized": 0, "normalized": 0}
    count, normalize = tokenizer.count, summarize_module._normalize

    def counting(text: str) -> int:
        read["tokenized"] += len(text)
        return count(text)

    def normalizing(line: str) -> str:
        read["normalized"] += len(line)
        return normalize(line)

    monkeypatch.setattr(tokenizer, "count", counting)
    monkeypatch.setattr(summarize_module, "_normalize", normalizing)
    agent = Agent.open(
        None,
        settings=load_settings(data_dir=tmp_path, embedder="hashing:64"),
        model=model,
        system_prompt="You look records up.",
        tools=[lookup],
        memory=False,
        context=ContextBudget(working_budget=4_000, summary_cap=3_000),
    )
    per_turn: list[dict[str, int]] = []
    summaries: list[str] = []
    try:
        for turn in range(32):
            read.update(tokenized=0, normalized=0)
            reply = await agent.handle("long", "u1", f"what do the records say about item {turn}?")
            assert reply.status == "completed", reply
            per_turn.append(dict(read))
            state = agent.session_state("long")
            assert state is not None
            summaries.append(state.runtime.summary)
    finally:
        await agent.aclose()
    # The workload is what this test says: the summary grows, by a fold at every late turn.
    assert len(summaries[30]) > 2 * len(summaries[12]) > 0, (summaries[12], summaries[30])
    assert all(a != b for a, b in pairwise(summaries[10:32]))
    for what in ("tokenized", "normalized"):
        early = [counts[what] for counts in per_turn[10:15]]
        late = [counts[what] for counts in per_turn[26:31]]
        # Before, each late turn read about 3 x 290 more characters to tokenize and 170 more
        # to normalize than each early one (about 18 more turns' summary lines).
        assert statistics.median(late) <= statistics.median(early) + 40, (what, early, late)
