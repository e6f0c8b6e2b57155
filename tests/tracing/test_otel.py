from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from keel.errors import ToolExecutionError
from keel.messages import Usage
from keel.stores import SQLiteDatabase
from keel.stores._sql_traces import SQLTraceStore
from keel.tracing import OpenTelemetryExporter, Tracer, export_run
from keel.tracing import _semconv as sc


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _trace_a_run(tracer: Tracer) -> str:
    with tracer.start_run("sess-1", user_id="u1", agent="booker") as run:
        with run.step("model", "openai:gpt-4o-mini", state_version=4) as call:
            call.first_token()
            call.update(
                usage=Usage(prompt_tokens=1200, completion_tokens=35),
                finish_reason="tool_calls",
                raw_output="call book for me@example.com",
            )
            with run.step(
                "tool", "book_flight", tool_call_id="call_9", tool_arguments='{"f": "TP1"}'
            ) as tool:
                tool.fail(ToolExecutionError("sold out"))
        run.transition("search", "book", state_version=5)
    return run.run_id


def test_live_export_uses_genai_conventions() -> None:
    provider, memory = _provider()
    tracer = Tracer(None, exporters=[OpenTelemetryExporter(provider)])
    run_id = _trace_a_run(tracer)
    spans = {span.name: span for span in memory.get_finished_spans()}
    assert set(spans) == {
        "invoke_agent booker",
        "chat gpt-4o-mini",
        "execute_tool book_flight",
        "keel.transition search->book",
    }
    root = spans["invoke_agent booker"]
    chat = spans["chat gpt-4o-mini"]
    tool = spans["execute_tool book_flight"]
    assert root.parent is None and root.attributes is not None
    assert root.attributes[sc.GEN_AI_OPERATION_NAME] == "invoke_agent"
    assert root.attributes[sc.GEN_AI_CONVERSATION_ID] == "sess-1"
    assert root.attributes[sc.KEEL_RUN_ID] == run_id
    assert root.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] == 1200
    assert chat.parent is not None and chat.parent.span_id == root.context.span_id
    assert chat.kind == SpanKind.CLIENT and chat.attributes is not None
    assert chat.attributes[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert chat.attributes[sc.GEN_AI_PROVIDER_NAME] == "openai"
    assert chat.attributes[sc.GEN_AI_REQUEST_MODEL] == "gpt-4o-mini"
    assert chat.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] == 1200
    assert chat.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 35
    assert tuple(chat.attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS]) == ("tool_calls",)
    assert chat.attributes[sc.KEEL_STATE_VERSION] == 4
    assert sc.KEEL_TTFT_MS in chat.attributes
    assert sc.KEEL_RAW_OUTPUT not in chat.attributes  # content is opt-in
    assert tool.parent is not None and tool.parent.span_id == chat.context.span_id
    assert tool.attributes is not None
    assert tool.attributes[sc.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert tool.attributes[sc.GEN_AI_TOOL_NAME] == "book_flight"
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ID] == "call_9"
    assert tool.attributes[sc.ERROR_TYPE] == "ToolExecutionError"
    assert tool.status.status_code == StatusCode.ERROR
    assert sc.GEN_AI_TOOL_CALL_ARGUMENTS not in tool.attributes
    for span in spans.values():
        assert span.start_time is not None and span.end_time is not None
        assert span.end_time >= span.start_time
        assert span.context.trace_id == root.context.trace_id


def test_stored_runs_export_later_with_redacted_content(tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "keel.db")
    store = SQLTraceStore(database)
    run_id = _trace_a_run(Tracer(store))
    detail = store.get_run_detail(run_id)
    store.close()
    database.close()
    assert detail is not None
    provider, memory = _provider()
    export_run(detail, provider, capture_content=True)
    spans = {span.name: span for span in memory.get_finished_spans()}
    chat = spans["chat gpt-4o-mini"]
    assert chat.attributes is not None
    raw = chat.attributes[sc.KEEL_RAW_OUTPUT]
    assert isinstance(raw, str) and "me@example.com" not in raw and "<EMAIL_1>" in raw
    tool = spans["execute_tool book_flight"]
    assert tool.attributes is not None
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"f": "TP1"}'
    root = spans["invoke_agent booker"]
    assert root.start_time == int(detail.run.started_at.timestamp() * 1_000_000_000)


def test_attribute_names_live_in_one_module() -> None:
    import keel.tracing._otel as otel_module

    source = Path(otel_module.__file__).read_text()
    assert '"gen_ai.' not in source and "'gen_ai." not in source
    assert sc.GEN_AI_USAGE_INPUT_TOKENS == "gen_ai.usage.input_tokens"
    assert sc.GEN_AI_TOOL_CALL_ID == "gen_ai.tool.call.id"
