"""What a step carries and how a run ends: the fields of a step, the run's final status.

[`StepFields`][keel.tracing.StepFields] are the keyword arguments every step takes;
[`status_for`][keel.tracing.status_for] is the status an exception ends a run with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypedDict

from pydantic import BaseModel

from keel.errors import (
    GuardError,
    LoopDetectedError,
    StepLimitError,
    TimeLimitError,
    ToolInDoubtError,
    TurnInterruptedError,
)
from keel.messages import Usage
from keel.models import Completion
from keel.tracing._models import Run, RunStatus, Step

__all__ = ["Final", "StepFields", "TraceExporter", "status_for"]

# (status, ended_at, output, error_type, error_message) of a run being ended.
Final = tuple[RunStatus, datetime, str | None, str | None, str | None]


class StepFields(TypedDict, total=False):
    """The fields a step can carry; every one is optional. Passed as keyword arguments.

    Text fields are redacted before storage; ``budget``, ``parsed_action`` and ``attributes``
    are redacted recursively (every string value). Pydantic models are dumped to JSON.
    ``usage`` fills the token counts; ``completion`` (a [`keel.models.Completion`][]) fills
    tokens, model, finish reason, time to first token, attempt and the raw output (the text, or
    the assistant message in the OpenAI wire format when it calls tools). Explicit fields win.
    """

    prompt_tokens: int
    completion_tokens: int
    usage: Usage
    completion: Completion
    model: str | None
    finish_reason: str | None
    budget: Mapping[str, Any] | BaseModel | None
    state_version: int | None
    raw_output: str | None
    parsed_action: Any
    tool_name: str | None
    tool_call_id: str | None
    tool_arguments: str | Mapping[str, Any] | None
    tool_result: Any
    error: BaseException | None
    error_type: str | None
    error_message: str | None
    latency_ms: float | None
    ttft_ms: float | None
    attempt: int
    attributes: Mapping[str, Any]


class TraceExporter(Protocol):
    """Receives each finished run with its steps (already redacted), e.g. for OpenTelemetry."""

    def export(self, run: Run, steps: Sequence[Step]) -> None:
        """Export one finished run."""


def status_for(error: BaseException | None) -> RunStatus:
    """The run status an exception ends a run with.

    Step and time limits -> ``limited``; loops and tool calls in doubt -> ``escalated`` (a
    human or the caller must decide); a turn interrupted with its turn left open ->
    ``interrupted``; anything else -> ``failed``; no error -> ``succeeded``.
    """
    if error is None:
        return "succeeded"
    if isinstance(error, TurnInterruptedError):
        return "interrupted"
    if isinstance(error, StepLimitError | TimeLimitError):
        return "limited"
    if isinstance(error, LoopDetectedError | ToolInDoubtError):
        return "escalated"
    if isinstance(error, GuardError):
        return "limited"
    return "failed"
