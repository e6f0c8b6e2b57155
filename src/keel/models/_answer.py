"""What the models share about the answer they return: a streamed answer put together from its
pieces (text, tool calls, time to first output), and the refusal of an answer cut short."""

from __future__ import annotations

import time
from collections.abc import Sequence

from keel.errors import TruncatedResponseError
from keel.messages import ToolCall
from keel.models._base import Completion, CompletionChunk, ModelOptions, ToolCallDelta

__all__ = ["StreamedAnswer", "refuse_cut_answer", "whole_call_deltas"]


class StreamedAnswer:
    """The answer a stream is building, from the pieces it has yielded.

    Args:
        started: ``time.perf_counter()`` when the request began (time to first output is
            measured from it).
    """

    def __init__(self, started: float) -> None:
        self.started = started
        self.ttft_ms: float | None = None
        self._pieces: list[str] = []
        self._calls: dict[int, dict[str, str | None]] = {}

    def add(self, text: str, deltas: Sequence[ToolCallDelta] = ()) -> CompletionChunk | None:
        """Take one increment; the chunk that carries it to the caller (None when it is empty)."""
        for delta in deltas:
            slot = self._calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            if delta.id:
                slot["id"] = delta.id
            if delta.name:
                slot["name"] = f"{slot['name']}{delta.name}"
            slot["arguments"] = f"{slot['arguments']}{delta.arguments}"
        if not text and not deltas:
            return None
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.started) * 1000
        self._pieces.append(text)
        return CompletionChunk(text=text, tool_calls=tuple(deltas))

    @property
    def text(self) -> str:
        """Every text piece so far, joined."""
        return "".join(self._pieces)

    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls the pieces spelled, in their index order (a missing id, name or
        argument text gets a placeholder, so the caller can still answer the call)."""
        return tuple(
            ToolCall(
                id=slot["id"] or f"call_{index}",
                name=slot["name"] or "unnamed",
                arguments=slot["arguments"] or "{}",
            )
            for index, slot in sorted(self._calls.items())
        )


def whole_call_deltas(calls: Sequence[ToolCall]) -> tuple[ToolCallDelta, ...]:
    """Calls known only once the answer is whole (parsed from its text), one piece each."""
    return tuple(
        ToolCallDelta(index=index, id=call.id, name=call.name, arguments=call.arguments)
        for index, call in enumerate(calls)
    )


def refuse_cut_answer(completion: Completion, options: ModelOptions, model: str, cut: str) -> None:
    """Raise [`TruncatedResponseError`][] for an answer that stopped at max_tokens, unless
    the caller allows one; ``cut`` says where it stopped, for the message."""
    if completion.finish_reason == "length" and not options.allow_truncated:
        raise TruncatedResponseError(
            f"the answer was cut at {cut} (finish_reason=length); raise max_tokens or set "
            "allow_truncated",
            model=model,
            raw=completion,
        )
