"""A tool's output that holds a JSON text inside a JSON string carries its values behind two
levels of escapes (``j\\\\u00f6rg``): a tool that returns ``json.dumps`` of a dict holding
``json.dumps`` of its data (what an MCP server's JSON text looks like once wrapped again), and
a tool that returns a dict holding such a text, which keel itself writes as JSON. None of the
values reaches the database, in any of its forms (as written, escaped once, escaped twice):
not the session's messages, the tool journal nor the traces. The model is shown each output
masked and JSON at both levels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite, leaks

TOKEN = "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2"
CUSTOMER = {
    "email": "jörg.müller@bücher.example",
    "phone": "+1\u00a0415\u00a0555\u00a00132",
    "card": "4111\u00a01111\u00a01111\u00a01111",
    "auth": f"Bearer\n{TOKEN}",
}
shown: list[str] = []


@tool(side_effect=True, idempotent=False)
def export_customer(customer_id: str) -> str:
    """Export a customer as a JSON document wrapped in a JSON envelope (journalled).

    Args:
        customer_id: The customer's id.
    """
    return json.dumps({"content": json.dumps(CUSTOMER)})


@tool(side_effect=True, idempotent=False)
def fetch_customer(customer_id: str) -> dict[str, str]:
    """Fetch a customer: a JSON text in a dict, which keel writes as JSON (journalled).

    Args:
        customer_id: The customer's id.
    """
    return {"content": json.dumps(CUSTOMER)}


def _reply(call: ScriptedCall) -> Message | str:
    results = [m for m in call.messages if m.role == "tool"]
    if results:
        shown.extend(str(m.content) for m in results)
        return "Done."
    arguments = json.dumps({"customer_id": "c-17"})
    return Message.assistant(
        "",
        tool_calls=[
            ToolCall(id="c1", name="export_customer", arguments=arguments),
            ToolCall(id="c2", name="fetch_customer", arguments=arguments),
        ],
    )


def _forms(value: str) -> set[str]:
    """The value as written, escaped once and escaped twice (with and without its spaces)."""
    once = json.dumps(value)[1:-1]
    twice = json.dumps(once)[1:-1]
    forms = {value, once, twice, value.replace("\u00a0", "")}
    forms |= {form.replace("\\u00a0", "") for form in (once, twice)}
    return forms


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    shown.clear()
    yield tmp_path / "keel.db"


async def test_values_in_json_encoded_twice_never_reach_the_database(database: Path) -> None:
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You export customers.",
        model=ScriptedModel(_reply),
        tools=[export_customer, fetch_customer],
    )
    try:
        reply = await agent.run("Export customer c-17.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    assert len(shown) == 2
    for output in shown:
        masked = json.loads(json.loads(output)["content"])
        assert masked.keys() == CUSTOMER.keys()
        assert re.fullmatch(r"<EMAIL_\d>", masked["email"]), masked
        assert re.fullmatch(r"<PHONE_\d>", masked["phone"]), masked
        assert re.fullmatch(r"<CREDIT_CARD_\d>", masked["card"]), masked
        assert re.fullmatch(r"Bearer\n<BEARER_TOKEN_\d>", masked["auth"]), masked
    dumped = dump_sqlite(database)
    assert "export_customer" in dumped["keel_tool_journal"]
    assert "fetch_customer" in dumped["keel_tool_journal"]
    assert any(table.startswith("trace") for table in dumped)
    leaked = leaks(dumped, {**CUSTOMER, "token": TOKEN}, forms=_forms)
    assert leaked == []
    assert "<CREDIT_CARD_" in dumped["keel_tool_journal"]


# A long output is masked line by line, each line found clean kept so as not to be read again.
# A line with an escaped backslash may read as the rest of the text says: "C:\\nGB82 ..." is a
# path or a line break before an IBAN (another line holds a \\uXXXX escaped again). Such a
# text is read both ways and never kept clean: kept from the first output, it was not read in
# the second.
_REPORT = "\n".join(f"line {i} of the nightly report, all checks passed" for i in range(30))
_PATH_LINE = "path: C:\\\\nGB82 WEST 1234 5698 7654 32"
OUTPUTS = {
    "first": f"{_PATH_LINE}\n{_REPORT}",
    "second": f"{_PATH_LINE}\nnote: caf\\\\u00e9\n{_REPORT}",
}


@tool(side_effect=True, idempotent=False)
def read_report(part: str) -> str:
    """Read one part of the nightly report (journalled).

    Args:
        part: first or second.
    """
    return OUTPUTS[part]


async def test_a_line_read_again_in_another_output_is_masked_as_that_output_reads_it(
    database: Path,
) -> None:
    def reply(call: ScriptedCall) -> Message | str:
        results = [m for m in call.messages if m.role == "tool"]
        if len(results) == 2:
            shown.extend(str(m.content) for m in results)
            return "Done."
        part = "second" if results else "first"
        arguments = json.dumps({"part": part})
        return Message.assistant(
            "", tool_calls=[ToolCall(id=part, name="read_report", arguments=arguments)]
        )

    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You read reports.",
        model=ScriptedModel(reply),
        tools=[read_report],
    )
    try:
        result = await agent.run("Read the report.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert result.status == "completed", result
    first, second = shown
    assert first.startswith("path: C:\\\\n<IBAN_"), first[:60]  # read both ways
    assert second.startswith("path: C:\\\\n<IBAN_"), second[:60]
    dumped = dump_sqlite(database)
    [row] = [row for row in dumped["keel_tool_journal"].split("key=") if '"second"' in row]
    assert "GB82" not in row and "<IBAN_" in row, row
