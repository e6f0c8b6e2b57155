"""A turn's passes over its prompt's window, counted where users stand (``Agent.handle``).

A turn sends the model a prompt of the whole window, but the work keel does around it need not
read the window again. The model is handed the compiled prompt itself (a tuple nothing can
change), not a copy of it made on the way; and the trace's record of each step's prompt (the
session's stored messages as position ranges) comes from where the context engine placed the
history's messages, not from comparing the prompt with the history item by item. Both are
checked by what they touch, not by time: which object the model got, and how many messages
the record's comparisons read. The session runs long enough to fold old turns into its summary
and prune old tool output, and on into a second agent (another process, the log built again
from the store after the summary), where the log's positions no longer start at the
conversation's first message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from keel.context import CompiledPrompt, ContextBudget
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tokens import ChatTokenCounter
from keel.tools import tool
from keel.tracing import _loop


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    # Every fifth record is long: pruned once it is old, a message the prompt shows cut.
    long = query.endswith(("5", "0"))
    return f"the record for {query}: " + ("details of it " * (300 if long else 2))


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here it is."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-6:]}))


def _agent(directory: Path, model: ScriptedModel) -> Agent:
    return Agent.open(
        None,
        settings=load_settings(data_dir=directory, embedder="hashing:64"),
        model=model,
        system_prompt="You look records up.",
        tools=[lookup],
        memory=False,
        context=ContextBudget(working_budget=6_000),
    )


class _Steps:
    """Each traced step's prompt record, checked against the record made by comparing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.compared: list[int] = []
        self.windows: list[int] = []
        self.summarized = 0
        self.cut = 0
        self._reading = 0
        record, run_length = _loop.prompt_record, _loop.equal_run_length

        def counted_run_length(
            messages: Sequence[Message], i: int, other: Sequence[Message], j: int, span: int
        ) -> int:
            self._reading += span
            return run_length(messages, i, other, j, span)

        def checked(
            prompt: Sequence[Message],
            history: Sequence[Message],
            runs: Sequence[tuple[int, int, int]] | None = None,
        ) -> list[dict[str, Any]]:
            self._reading = 0
            kept = record(prompt, history, runs)
            self.compared.append(self._reading)
            self.windows.append(sum(length for _, _, length in runs or ()))
            # What comparing every run of the window records.
            assert kept == record(list(prompt), list(history))
            self.summarized += any(m.content.startswith("Summary of") for m in prompt)
            self.cut += any("keel_cut" in m.metadata for m in prompt)
            return kept

        monkeypatch.setattr(_loop, "equal_run_length", counted_run_length)
        monkeypatch.setattr(_loop, "prompt_record", checked)


async def test_a_steps_prompt_is_recorded_without_reading_its_window_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _Steps(monkeypatch)
    for run in range(2):
        agent = _agent(tmp_path, ScriptedModel(_policy, keep_calls=0))
        try:
            for turn in range(60):
                reply = await agent.handle("long", "u1", f"look up item {run * 100 + turn}")
                assert reply.status == "completed" and reply.tool_calls == ("lookup",)
        finally:
            await agent.aclose()
    assert steps.summarized > 100, "the session never folded turns into its summary"
    assert steps.cut > 100, "no prompt showed a pruned tool output"
    assert max(steps.windows) > 60
    # Comparing would read each step's window (some sixty messages and more); the runs the
    # engine knows leave nothing to compare.
    assert max(steps.compared) == 0, steps.compared


async def test_the_model_is_handed_the_compiled_prompt_itself(tmp_path: Path) -> None:
    model = ScriptedModel(_policy)
    agent = _agent(tmp_path, model)
    compiled: list[CompiledPrompt] = []
    compile_prompt = agent.engine.compile

    def kept(*args: Any, **options: Any) -> CompiledPrompt:
        compiled.append(compile_prompt(*args, **options))
        return compiled[-1]

    agent.engine.compile = kept  # type: ignore[method-assign]
    try:
        for turn in range(5):
            assert (await agent.handle("s", "u1", f"look up item {turn}")).status == "completed"
    finally:
        await agent.aclose()
    assert len(model.calls) == len(compiled) == 10
    # No copy of the window on the way from the engine to the model (the runtime's, the
    # masking's, the model's own): the very tuple the engine built, whatever its length.
    for call, prompt in zip(model.calls, compiled, strict=True):
        assert call.messages is prompt.messages


class _Reporting(ScriptedModel):
    """A scripted model whose usage reports are kept with an independent count of each
    prompt (a counter of its own, which has counted nothing before)."""

    def __init__(self) -> None:
        super().__init__(_policy, keep_calls=0)
        self.reports: list[tuple[int, int]] = []
        self.fresh = ChatTokenCounter(self.counter.profile, self.counter.tokenizer)

    async def _acomplete(self, messages: Any, tools: Any, options: Any) -> Any:
        completion = await super()._acomplete(messages, tools, options)
        exact = self.fresh.count_prompt(list(messages), tools)
        self.reports.append((completion.usage.prompt_tokens, exact))
        return completion


async def test_the_models_usage_count_reads_none_of_the_prompts_messages(tmp_path: Path) -> None:
    model = _Reporting()
    compared: list[int] = []
    count_list = model.counter._count_list

    def counted(messages: tuple[Message, ...]) -> int:
        compared.append(len(messages))
        return count_list(messages)

    agent = _agent(tmp_path, model)
    model.counter._count_list = counted  # type: ignore[method-assign]
    try:
        for turn in range(40):
            assert (await agent.handle("s", "u1", f"look up item {turn}")).status == "completed"
    finally:
        await agent.aclose()
    # The model counts each prompt it is handed (its usage report): the engine noted the
    # compiled tuple's count as it built it, so no message of it is looked up or compared...
    assert compared == []
    # ... and the count is exact, as a counter that never saw the engine's says.
    assert len(model.reports) == 80
    assert all(reported == exact for reported, exact in model.reports), model.reports
