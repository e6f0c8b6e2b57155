"""What the executor journals is masked: arguments, results, failures; replay stays exactly-once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.messages import ToolCall
from keel.privacy import PIIMasker, mask_pii
from keel.stores import SQLiteDatabase, SQLToolJournal
from keel.tools import (
    InMemoryJournal,
    ToolExecutor,
    ToolJournal,
    ToolRegistry,
    ToolResult,
    idempotency_key,
    tool,
)
from tests.privacy._samples import TOOL_PII, USER_PII, dump_sqlite, leaks, sentence

runs: list[dict[str, str]] = []


@tool(side_effect=True, idempotent=False)
def file_claim(customer: str, note: str) -> str:
    """File a claim (an effect: it runs once)."""
    runs.append({"customer": customer, "note": note})
    return f"claim filed; the insurer answers at {sentence(TOOL_PII)}"


@tool(side_effect=True)
def refuse(customer: str) -> str:
    """Always fails, naming the customer."""
    raise ValueError(f"no policy for {customer}, {sentence(TOOL_PII)}")


@tool(side_effect=True, max_output_chars=40)
def statement(account: str) -> str:
    """A long statement whose cap falls inside a key."""
    return "statement: " + "x" * 20 + " " + TOOL_PII["API_KEY"] + " " + sentence(TOOL_PII)


ARGUMENTS = json.dumps({"customer": USER_PII["EMAIL"], "note": sentence(USER_PII)})


@pytest.fixture(autouse=True)
def _clear() -> None:
    runs.clear()


@pytest.fixture(params=["memory", "sqlite"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ToolJournal]:
    if request.param == "memory":
        yield InMemoryJournal()
        return
    db = SQLiteDatabase(tmp_path / "keel.db")
    yield SQLToolJournal(db)
    db.close()


def _executor(journal: ToolJournal, redact: object = mask_pii) -> ToolExecutor:
    return ToolExecutor(
        ToolRegistry([file_claim, refuse, statement]),
        journal=journal,
        redact=redact,  # type: ignore[arg-type]
    )


async def _run(executor: ToolExecutor, name: str, arguments: str, step: int = 1) -> ToolResult:
    call = ToolCall(id="call_1", name=name, arguments=arguments)
    return await executor.execute(call, session_id="s1", step=step, call_index=0)


def _journalled(journal: ToolJournal) -> str:
    return "\n".join(entry.model_dump_json() for entry in journal.entries())


async def test_arguments_and_results_are_journalled_masked(journal: ToolJournal) -> None:
    result = await _run(_executor(journal), "file_claim", ARGUMENTS)
    assert result.ok and result.executed
    # The tool gets the arguments as the model wrote them, and the model its real output
    # (the agent masks messages at its door); only what is persisted is masked.
    assert runs == [{"customer": USER_PII["EMAIL"], "note": sentence(USER_PII)}]
    assert TOOL_PII["IBAN"] in result.content
    entry = journal.get(idempotency_key("s1", 1, 0))
    assert entry is not None and entry.status == "succeeded"
    assert leaks({"journal": _journalled(journal)}, USER_PII, TOOL_PII) == []
    assert json.loads(entry.arguments) == {
        "customer": "<EMAIL_1>",
        "note": mask_pii(sentence(USER_PII)),
    }
    assert entry.content is not None and "<IBAN_1>" in entry.content
    assert entry.output == entry.content


async def test_a_replayed_call_returns_the_masked_result_without_running_again(
    journal: ToolJournal,
) -> None:
    first = await _run(_executor(journal), "file_claim", ARGUMENTS)
    again = await _run(_executor(journal), "file_claim", ARGUMENTS)
    assert len(runs) == 1
    # The key is derived from (session, step, call) exactly as without masking.
    assert first.idempotency_key == again.idempotency_key == idempotency_key("s1", 1, 0)
    assert again.ok and again.replayed and not again.executed
    assert again.content == mask_pii(first.content)
    assert leaks({"replayed": again.model_dump_json()}, TOOL_PII) == []


async def test_a_failure_is_journalled_masked(journal: ToolJournal) -> None:
    result = await _run(_executor(journal), "refuse", json.dumps({"customer": USER_PII["EMAIL"]}))
    assert result.status == "failed" and USER_PII["EMAIL"] in result.content
    entry = journal.get(idempotency_key("s1", 1, 0))
    assert entry is not None and entry.status == "failed"
    assert leaks({"journal": _journalled(journal)}, USER_PII, TOOL_PII) == []


async def test_the_output_is_masked_before_it_is_capped(journal: ToolJournal) -> None:
    result = await _run(_executor(journal), "statement", json.dumps({"account": "a1"}))
    assert result.truncated and "sk-live-" in result.content  # the cap cut the key
    entry = journal.get(idempotency_key("s1", 1, 0))
    assert entry is not None and entry.content is not None
    assert "sk-live" not in entry.content and "<API_KEY" in entry.content
    assert leaks({"journal": _journalled(journal)}, TOOL_PII) == []


async def test_a_tenant_policy_object_is_a_redactor(journal: ToolJournal) -> None:
    masker = PIIMasker()
    await _run(_executor(journal, redact=masker), "file_claim", ARGUMENTS)
    assert leaks({"journal": _journalled(journal)}, USER_PII, TOOL_PII) == []


async def test_without_a_redactor_the_journal_keeps_the_texts(journal: ToolJournal) -> None:
    await _run(_executor(journal, redact=None), "file_claim", ARGUMENTS)
    assert USER_PII["EMAIL"] in _journalled(journal)


async def test_a_failing_redactor_never_journals_raw_text(
    journal: ToolJournal, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(text: str) -> str:
        raise RuntimeError("masker bug")

    refused = await _run(_executor(journal, redact=broken), "file_claim", ARGUMENTS)
    assert refused.status == "failed" and not refused.executed and runs == []
    assert "was not run" in refused.content and journal.entries() == []
    assert refused.error_type == "ToolExecutionError" and refused.exception is not None

    def results_only(text: str) -> str:
        if "claim filed" in text:
            raise RuntimeError("masker bug")
        return mask_pii(text)

    ran = await _run(_executor(journal, redact=results_only), "file_claim", ARGUMENTS, step=2)
    assert ran.ok and len(runs) == 1
    # The result could not be masked, so it is not kept: the call stays in doubt.
    assert [entry.step for entry in journal.in_doubt("s1")] == [2]
    assert "could not be masked" in caplog.text
    assert leaks({"journal": _journalled(journal)}, USER_PII, TOOL_PII) == []


async def test_nothing_raw_reaches_the_sqlite_file(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "journal.db")
    journal = SQLToolJournal(db)
    executor = _executor(journal)
    await _run(executor, "file_claim", ARGUMENTS, step=1)
    await _run(executor, "refuse", json.dumps({"customer": USER_PII["EMAIL"]}), step=2)
    await _run(executor, "statement", json.dumps({"account": USER_PII["IBAN"]}), step=3)
    db.close()
    dumped = dump_sqlite(tmp_path / "journal.db")
    assert "keel_tool_journal" in dumped
    assert leaks(dumped, USER_PII, TOOL_PII) == []
