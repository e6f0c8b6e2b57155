"""How one step of a model-and-tools loop becomes trace steps.

A loop step is one model call and the tool calls it asked for. In the trace it is a ``model``
step (usage, finish reason, the budget report of the prompt, the messages it was sent as the
history holds them, the raw output and the action parsed from it) with, under it, a ``tool``
step per call, a ``guard`` step per loop warning and a ``transition`` step per workflow move.
The runtime's own records satisfy the protocols below; tracing depends on their shape, not on
the runtime.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from pydantic import BaseModel

from keel.messages import Message, Usage, equal_run_length
from keel.tracing._tracer import RunTrace

__all__ = [
    "Compiled",
    "LoopStep",
    "SentPrompt",
    "ToolOutcome",
    "arecord_loop_step",
    "prompt_record",
]


Runs = Sequence[tuple[int, int, int]]
"""Runs of ``(index in the prompt, index in the history, length)`` where a prompt shows the
history's very message objects."""


class SentPrompt(NamedTuple):
    """The messages a model call was sent, and the session's stored (masked) messages its
    turns were taken from; ``runs``, when known, where the prompt shows them (see
    ``prompt_record``)."""

    messages: Sequence[Message]
    history: Sequence[Message]
    runs: Runs | None = None

    @classmethod
    def of(
        cls, compiled: Compiled | None, history: Sequence[Message], first: int = 0
    ) -> SentPrompt | None:
        """The messages of ``compiled`` (a compiled prompt) with ``history``, whose message
        ``first`` is the first of the conversation the prompt was compiled from (those
        before it summarized); None without a prompt."""
        if compiled is None:
            return None
        runs = [(index, first + number, length) for index, number, length in compiled.held]
        return cls(compiled.messages, history, runs)


class Compiled(Protocol):
    """What the trace reads of a compiled prompt (keel's ``CompiledPrompt``)."""

    @property
    def messages(self) -> Sequence[Message]: ...
    @property
    def held(self) -> Sequence[tuple[int, int, int]]: ...


KEPT_CHARS = 4_000
"""The most characters of one message a model step keeps whole (a block, a pruned output):
a long summary block would otherwise be stored, and redacted, again at every step."""


def prompt_record(
    prompt: Sequence[Message], history: Sequence[Message], runs: Runs | None = None
) -> list[dict[str, Any]]:
    """What a model step keeps of the ``prompt`` it was sent. A run of messages that are the
    session's stored ``history`` messages (the very objects) is one ``{"messages": [first,
    last]}``: their positions there, both included (the checkpoint of the step's
    ``state_version`` holds them). Any other message (the system prompt, the memories,
    summary and rules blocks, a pruned output) is kept whole, in the OpenAI wire format, its
    text cut at ``KEPT_CHARS`` (``"cut_chars"`` says how many were left out).
    Copying every message would store the window again at every step (a trace 30 times
    larger on ``keel bench turns``). The cost does not grow with the session: a run's start
    is found by a few guesses at where the prompt's turns sit (they are the newest), and the
    run itself is compared as lists in C (`equal_run_length`); a stored message no guess finds is
    kept whole, which is still what the model saw.

    ``runs`` (see `SentPrompt`), when the one who built the prompt knows them, say how far
    each run goes without comparing it: only the pair where a known run ends is compared
    (a longer run of equal messages is then followed as without them), so the record is the
    same, and its cost that of the prompt's blocks and runs, not of its window."""
    record: list[dict[str, Any]] = []
    known = _KnownRuns(runs) if runs is not None else None
    if known is None:
        # Lists both, so that their slices compare (a tuple never equals a list).
        prompt, history = _as_list(prompt), _as_list(history)
    total, stored = len(prompt), len(history)
    expected = -1  # where the next stored message would be if the last run went on
    kept_since = 0  # messages kept whole since the last run ended
    i = 0
    while i < total:
        message = prompt[i]
        remaining = total - i
        guesses = (
            expected,
            expected + kept_since,
            stored - remaining,
            stored - remaining + 1,
            stored - remaining + 2,
            stored - 1,
        )
        first = next((g for g in guesses if 0 <= g < stored and history[g] is message), None)
        if first is None:
            record.append(_kept_whole(message))
            kept_since += 1
            i += 1
            continue
        span = min(remaining, stored - first)
        if known is None:
            run = equal_run_length(prompt, i, history, first, span)
        else:
            run = known.length(prompt, i, history, first, span)
        record.append({"messages": [first, first + run - 1]})
        expected, kept_since = first + run, 0
        i += run
    return record


def _as_list(messages: Sequence[Message]) -> list[Message]:
    return messages if isinstance(messages, list) else list(messages)


class _KnownRuns:
    """`prompt_record`'s runs looked up by where they start in the prompt."""

    __slots__ = ("_runs", "_starts")

    def __init__(self, runs: Runs) -> None:
        self._runs = sorted(runs)
        self._starts = [index for index, _, _ in self._runs]

    def length(
        self,
        prompt: Sequence[Message],
        i: int,
        history: Sequence[Message],
        j: int,
        span: int,
    ) -> int:
        """What ``equal_run_length`` answers for ``prompt`` from ``i`` against ``history``
        from ``j`` (the first pair the same object), comparing only past the known run."""
        at = bisect_right(self._starts, i) - 1
        known = 0
        if at >= 0:
            index, number, length = self._runs[at]
            if number + (i - index) == j:
                known = min(max(0, index + length - i), span)
                if known and prompt[i + known - 1] is not history[j + known - 1]:
                    known = 0  # not the runs of this history after all: compared instead
        if known < span:
            mine, theirs = prompt[i + known], history[j + known]
            if known == 0 or mine is theirs or mine == theirs:
                # Past what is known (or none is): compared as before, as lists.
                rest = span - known
                known += equal_run_length(
                    _as_list(prompt[i + known : i + known + rest]),
                    0,
                    _as_list(history[j + known : j + known + rest]),
                    0,
                    rest,
                )
        return known


def _kept_whole(message: Message) -> dict[str, Any]:
    wire = message.to_openai()
    content = wire.get("content")
    if isinstance(content, str) and len(content) > KEPT_CHARS:
        wire["content"] = _kept_text(content)
        wire["cut_chars"] = len(content) - KEPT_CHARS
    return wire


@functools.lru_cache(maxsize=16)
def _kept_text(content: str) -> str:
    """The kept start of a long text: one string object for as long as the text comes back
    (the summary block, at every step until the next summary), so that what the trace does
    with it next (its redaction looked up, its UTF-8 for the JSON) is done once for it, not
    once per step; the look-up itself costs nothing more for the text object it has seen."""
    return content[:KEPT_CHARS]


class ToolOutcome(Protocol):
    """What the trace reads of one tool call (keel's ``ToolResult``)."""

    @property
    def tool(self) -> str: ...
    @property
    def call_id(self) -> str: ...
    @property
    def raw_arguments(self) -> str: ...
    @property
    def ok(self) -> bool: ...
    @property
    def output_text(self) -> str: ...
    @property
    def error_type(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def repairs(self) -> Sequence[str]: ...
    @property
    def replayed(self) -> bool: ...
    @property
    def truncated(self) -> bool: ...


class LoopStep(Protocol):
    """What the trace reads of one loop step (keel's ``StepRecord``)."""

    @property
    def step(self) -> int: ...
    @property
    def action(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def raw_output(self) -> str | None: ...
    @property
    def replayed_decision(self) -> bool: ...
    @property
    def tool_results(self) -> Sequence[ToolOutcome]: ...
    @property
    def guard_events(self) -> Sequence[str]: ...
    @property
    def error(self) -> str | None: ...
    @property
    def error_type(self) -> str | None: ...
    @property
    def model_latency_ms(self) -> float | None: ...
    @property
    def ttft_ms(self) -> float | None: ...


async def arecord_loop_step(
    run: RunTrace,
    step: LoopStep,
    *,
    model: str,
    budget: BaseModel | None = None,
    state_version: int | None = None,
    transitions: Sequence[tuple[str, str]] = (),
    prompt: SentPrompt | None = None,
) -> None:
    """Record ``step`` in ``run``: the model call, then each tool call, loop warning and
    workflow transition under it. ``model`` names the model when the step does not (a call
    that failed before any answer); ``budget`` is the prompt's budget report; ``prompt`` the
    messages the call was sent, masked as the history keeps them (never the values a trusted
    model is shown), with the session's stored messages its turns were taken from, kept in
    the step's ``prompt`` attribute (see ``prompt_record``)."""
    name = step.model or model
    attributes: dict[str, object] = {"step": step.step, "guard_events": list(step.guard_events)}
    if prompt is not None:
        attributes["prompt"] = prompt_record(prompt.messages, prompt.history, prompt.runs)
    model_step = await run.arecord(
        "model",
        name,
        usage=step.usage,
        model=name,
        finish_reason=step.finish_reason,
        budget=budget,
        state_version=state_version,
        raw_output=step.raw_output,
        parsed_action={
            "action": step.action,
            "tool_calls": [
                {"name": result.tool, "arguments": result.raw_arguments}
                for result in step.tool_results
            ],
            "replayed": step.replayed_decision,
        },
        error_type=step.error_type,
        error_message=step.error,
        latency_ms=step.model_latency_ms,
        ttft_ms=step.ttft_ms,
        attributes=attributes,
    )
    parent = model_step.step_id if model_step is not None else None
    for result in step.tool_results:
        await run.arecord(
            "tool",
            result.tool,
            parent=parent,
            tool_name=result.tool,
            tool_call_id=result.call_id,
            tool_arguments=result.raw_arguments,
            tool_result=result.output_text if result.ok else None,
            error_type=result.error_type,
            error_message=result.error,
            latency_ms=result.latency_ms,
            attributes={
                "repairs": list(result.repairs),
                "replayed": result.replayed,
                "truncated_for_model": result.truncated,
            },
        )
    for event in step.guard_events:
        if event.startswith("loop"):
            await run.arecord("guard", "loop", parent=parent, error_message=event)
    for source, target in transitions:
        await run.arecord(
            "transition",
            f"{source}->{target}",
            parent=parent,
            attributes={"source": source, "target": target},
        )
