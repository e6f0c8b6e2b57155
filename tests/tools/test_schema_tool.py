"""Tools defined by a JSON schema: the schema validates the model's arguments field by field,
the safe repairs apply, and a schema that is not one is refused when the tool is built."""

from __future__ import annotations

import json
from typing import Any

import pytest

from keel.errors import ToolArgumentsError, ToolDefinitionError
from keel.messages import ToolCall
from keel.tools import SchemaTool, ToolContext, ToolExecutor, ToolRegistry, schema_tool

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^#W[0-9]+$"},
        "quantity": {"type": "integer", "minimum": 1},
    },
    "required": ["order_id", "quantity"],
    "additionalProperties": False,
}


def _tool(seen: list[dict[str, Any]]) -> SchemaTool:
    async def cancel(arguments: dict[str, Any], context: ToolContext | None) -> str:
        seen.append(arguments)
        assert context is not None
        return f"cancelled {arguments['order_id']} (key {context.idempotency_key})"

    return schema_tool("cancel_order", "Cancel an order.", SCHEMA, cancel, side_effect=True)


async def _run(seen: list[dict[str, Any]], arguments: str) -> Any:
    executor = ToolExecutor(ToolRegistry([_tool(seen)]))
    call = ToolCall(id="c1", name="cancel_order", arguments=arguments)
    return await executor.execute(call, session_id="s1", step=1)


async def test_valid_arguments_reach_the_function_as_the_schema_describes_them() -> None:
    seen: list[dict[str, Any]] = []
    result = await _run(seen, '```json\n{"order_id": "#W1", "quantity": "2"}\n```')
    assert result.status == "ok", result.content
    assert seen == [{"order_id": "#W1", "quantity": 2}]
    assert "removed a markdown code fence" in result.repairs
    assert any("read as integer 2" in repair for repair in result.repairs)
    assert result.idempotency_key and result.idempotency_key in result.content


async def test_each_invalid_field_gets_its_own_line_and_nothing_runs() -> None:
    seen: list[dict[str, Any]] = []
    result = await _run(seen, json.dumps({"order_id": "W1", "quantity": 0, "force": True}))
    assert result.status == "invalid_arguments" and seen == []
    assert isinstance(result.exception, ToolArgumentsError)
    problems = "\n".join(result.problems)
    assert "Field 'order_id': 'W1' does not match" in problems
    assert "Field 'quantity': 0 is less than the minimum of 1" in problems
    assert "Field 'force': not an argument of this tool (valid arguments: order_id, quantity)" in (
        problems
    )
    missing = await _run(seen, json.dumps({"order_id": "#W2"}))
    assert missing.problems == ("Field 'quantity': Field required",) and seen == []


def test_the_model_sees_the_schema_as_given() -> None:
    built = _tool([])
    assert built.schema()["function"]["parameters"] == SCHEMA
    assert built.side_effect and not built.idempotent


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array"},
        {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
        {"type": "object", "properties": []},
    ],
)
def test_a_schema_that_is_not_one_of_an_object_is_refused(schema: dict[str, Any]) -> None:
    async def never(arguments: dict[str, Any], context: ToolContext | None) -> str:
        raise AssertionError

    with pytest.raises(ToolDefinitionError, match="broken"):
        schema_tool("broken", "Broken.", schema, never)
