"""A Tracer built with its defaults masks every PII kind, not only credentials."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import mask_pii
from keel.stores import SQLiteDatabase
from keel.stores._sql_traces import SQLTraceStore
from keel.tracing import Tracer, redact_pii
from tests.privacy._samples import MODEL_PII, TOOL_PII, USER_PII, dump_sqlite, leaks, sentence


def test_the_default_redactor_masks_every_pii_kind_and_every_credential() -> None:
    for values in (USER_PII, TOOL_PII, MODEL_PII):
        masked = redact_pii(sentence(values))
        assert leaks({"masked": masked}, values) == [], masked
        assert masked == mask_pii(sentence(values))  # the placeholders memory holds
    # What only the credentials redactor knows is kept from it.
    masked = redact_pii("password=hunter2hunter2, Authorization: Basic dXNlcjpwYXNzd29yZA==")
    assert "hunter2" not in masked and "dXNlcjpw" not in masked


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab@.-+ 0123456789sk-_:=/AZ"), max_size=80))
def test_redact_pii_is_idempotent(text: str) -> None:
    once = redact_pii(text)
    assert redact_pii(once) == once


def test_a_default_tracer_stores_no_pii(tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "traces.db")
    store = SQLTraceStore(database)
    tracer = Tracer(store)
    with tracer.start_run("s1", user_id="u1", input=sentence(USER_PII)) as run:
        with run.step(
            "model",
            "scripted:x",
            raw_output=sentence(MODEL_PII),
            parsed_action={"tool_calls": [{"arguments": sentence(MODEL_PII)}]},
            attributes={"note": sentence(USER_PII)},
        ):
            run.record(
                "tool",
                "file_claim",
                tool_arguments={"customer": MODEL_PII["EMAIL"], "note": sentence(MODEL_PII)},
                tool_result=sentence(TOOL_PII),
                error_message=f"failed for {sentence(TOOL_PII)}",
            )
        run.end(output=sentence(MODEL_PII))
    store.close()
    database.close()
    dumped = dump_sqlite(tmp_path / "traces.db")
    assert dumped.get("trace_steps") and dumped.get("trace_runs")
    assert leaks(dumped, USER_PII, TOOL_PII, MODEL_PII) == []
