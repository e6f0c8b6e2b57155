"""Export runs and steps as OpenTelemetry spans, with the GenAI semantic conventions.

A run becomes an ``invoke_agent {agent}`` span; each model step a ``chat {model}`` span, each
tool step an ``execute_tool {tool}`` span, every other step a ``keel.{kind} {name}`` span, all
nested as the steps are, with the real start and end times. The OpenTelemetry SDK is imported
only when an exporter is made (the ``otel`` extra). Message contents (raw output, tool arguments
and results) are sensitive, so they are exported only with ``capture_content=True``, and then
only in their redacted form.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from keel._version import __version__
from keel.tracing import _semconv as sc
from keel.tracing._models import Run, RunDetail, Step

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider

__all__ = ["OpenTelemetryExporter", "export_run"]


def _ns(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1_000_000_000)


def _split_model(spec: str | None) -> tuple[str | None, str | None]:
    """(provider, model) of a keel model spec such as ``openai:gpt-4o-mini``."""
    if not spec:
        return None, None
    provider, sep, model = spec.partition(":")
    if not sep:
        return None, spec
    return provider, model.split("@", 1)[0] or spec


def _present(attributes: dict[str, Any]) -> dict[str, Any]:
    """The attributes that have a value: OpenTelemetry takes no None."""
    return {key: value for key, value in attributes.items() if value is not None}


def _run_attributes(run: Run) -> dict[str, Any]:
    return {
        sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT,
        sc.GEN_AI_AGENT_NAME: run.agent,
        sc.GEN_AI_CONVERSATION_ID: run.session_id,
        sc.KEEL_RUN_ID: run.run_id,
        sc.KEEL_RUN_STATUS: run.status,
        sc.GEN_AI_USAGE_INPUT_TOKENS: run.prompt_tokens,
        sc.GEN_AI_USAGE_OUTPUT_TOKENS: run.completion_tokens,
        **_present(
            {
                sc.KEEL_USER_ID: run.user_id,
                sc.KEEL_TENANT_ID: run.tenant_id,
                sc.ERROR_TYPE: run.error_type,
            }
        ),
    }


def _step_attributes(step: Step, capture_content: bool) -> tuple[str, dict[str, Any]]:
    attributes: dict[str, Any] = {
        sc.KEEL_RUN_ID: step.run_id,
        sc.KEEL_STEP_ID: step.step_id,
        sc.KEEL_STEP_KIND: step.kind,
        sc.KEEL_STEP_NAME: step.name,
        sc.KEEL_ATTEMPT: step.attempt,
        **_present(
            {
                sc.KEEL_LATENCY_MS: step.latency_ms,
                sc.KEEL_STATE_VERSION: step.state_version,
                sc.ERROR_TYPE: step.error_type,
            }
        ),
    }
    if step.kind == "model":
        provider, model = _split_model(step.model or step.name)
        attributes[sc.GEN_AI_OPERATION_NAME] = sc.OP_CHAT
        if provider:
            attributes[sc.GEN_AI_PROVIDER_NAME] = provider
        if model:
            attributes[sc.GEN_AI_REQUEST_MODEL] = model
            attributes[sc.GEN_AI_RESPONSE_MODEL] = model
        attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] = step.prompt_tokens
        attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = step.completion_tokens
        if step.finish_reason:
            attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = (step.finish_reason,)
        if step.ttft_ms is not None:
            attributes[sc.KEEL_TTFT_MS] = step.ttft_ms
        if step.budget is not None:
            attributes[sc.KEEL_BUDGET] = json.dumps(step.budget, ensure_ascii=False)
        if capture_content and step.raw_output is not None:
            attributes[sc.KEEL_RAW_OUTPUT] = step.raw_output
        return f"{sc.OP_CHAT} {model or step.name}".strip(), attributes
    if step.kind == "tool":
        tool = step.tool_name or step.name
        attributes[sc.GEN_AI_OPERATION_NAME] = sc.OP_EXECUTE_TOOL
        attributes[sc.GEN_AI_TOOL_NAME] = tool
        attributes[sc.GEN_AI_TOOL_TYPE] = "function"
        if step.tool_call_id:
            attributes[sc.GEN_AI_TOOL_CALL_ID] = step.tool_call_id
        if capture_content:
            if step.tool_arguments is not None:
                attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] = step.tool_arguments
            if step.tool_result is not None:
                attributes[sc.GEN_AI_TOOL_CALL_RESULT] = step.tool_result
        return f"{sc.OP_EXECUTE_TOOL} {tool}", attributes
    return f"keel.{step.kind} {step.name}".strip(), attributes


class OpenTelemetryExporter:
    """A [`TraceExporter`][] that emits OpenTelemetry spans.

    Args:
        tracer_provider: the provider to emit through; the global one by default.
        capture_content: also export raw model output and tool arguments/results (redacted).
    """

    def __init__(
        self, tracer_provider: TracerProvider | None = None, *, capture_content: bool = False
    ) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = trace.get_tracer(
            sc.TRACER_NAME, __version__, tracer_provider=tracer_provider
        )
        self.capture_content = capture_content

    def export(self, run: Run, steps: Sequence[Step]) -> None:
        """Emit the run and its steps as one span tree."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        trace = self._trace
        root = self._tracer.start_span(
            f"{sc.OP_INVOKE_AGENT} {run.agent}",
            kind=SpanKind.INTERNAL,
            attributes=_run_attributes(run),
            start_time=_ns(run.started_at),
        )
        if run.status in ("failed", "limited", "escalated"):
            root.set_status(Status(StatusCode.ERROR, run.error_message or run.status))
        spans: dict[str, Span] = {}
        ordered = sorted(steps, key=lambda step: step.seq)
        for step in ordered:
            parent = spans.get(step.parent_id or "", root)
            name, attributes = _step_attributes(step, self.capture_content)
            span = self._tracer.start_span(
                name,
                context=trace.set_span_in_context(parent),
                kind=SpanKind.CLIENT if step.kind == "model" else SpanKind.INTERNAL,
                attributes=attributes,
                start_time=_ns(step.started_at),
            )
            if step.error_type is not None:
                span.set_status(Status(StatusCode.ERROR, step.error_message or step.error_type))
            spans[step.step_id] = span
        for step in ordered:
            spans[step.step_id].end(end_time=_ns(step.ended_at or step.started_at))
        root.end(end_time=_ns(run.ended_at or (ordered[-1].ended_at if ordered else None)))


def export_run(
    detail: RunDetail,
    tracer_provider: TracerProvider | None = None,
    *,
    capture_content: bool = False,
) -> None:
    """Export a stored run (from [`TraceStore.get_run_detail`][]) as OpenTelemetry spans."""
    OpenTelemetryExporter(tracer_provider, capture_content=capture_content).export(
        detail.run, detail.steps
    )
