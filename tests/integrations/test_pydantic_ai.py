"""keel's context engine inside pydantic-ai, through its own Agent and FunctionModel: every
request fits the budget, no tool return is ever sent without its call (pydantic-ai#4728),
older turns fold into one summary, and the history pydantic-ai keeps stays consistent."""

from __future__ import annotations

import json

from pydantic import BaseModel, Field
from pydantic_ai import Agent, PromptedOutput
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from keel.context import ContextBudget
from keel.integrations.pydantic_ai import SUMMARY_MARK, KeelHistory
from keel.messages import Message
from keel.tokens import counter_for

BUDGET = ContextBudget(working_budget=3_000)


def _orphans(messages: list[ModelMessage]) -> list[str]:
    """Tool returns sent without their call earlier in the same request list, and calls left
    without a return before the next model response."""
    called: set[str] = set()
    returned: set[str] = set()
    problems: list[str] = []
    for message in messages:
        if isinstance(message, ModelResponse):
            pending = called - returned
            if pending:
                problems.append(f"calls without a return: {sorted(pending)}")
            called |= {p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)}
        else:
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    if part.tool_call_id not in called:
                        problems.append(f"return without its call: {part.tool_call_id}")
                    returned.add(part.tool_call_id)
    return problems


def _tokens(messages: list[ModelMessage], info: AgentInfo | None = None) -> int:
    """The request as keel counts it for gpt-4o (the same conversion a provider makes): with
    ``info``, the instructions and tool definitions it sends besides the history too."""
    counted: list[Message] = []
    tools: list[dict[str, object]] = []
    if info is not None:
        if info.instructions:
            counted.append(Message.system(info.instructions))
        tools = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.parameters_json_schema,
                },
            }
            for tool in [*info.function_tools, *info.output_tools]
        ]
    for message in messages:
        if isinstance(message, ModelResponse):
            text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
            counted.append(Message.assistant(text or " "))
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    counted.append(Message.assistant(part.args_as_json_str()))
            continue
        for part in message.parts:
            if isinstance(part, SystemPromptPart | UserPromptPart):
                counted.append(Message.user(str(part.content)))
            elif isinstance(part, ToolReturnPart):
                counted.append(Message.user(part.model_response_str()))
    return counter_for("gpt-4o").count_prompt(counted, tools)


async def test_every_request_fits_and_keeps_calls_with_their_returns() -> None:
    seen: list[list[ModelMessage]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(list(messages))
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        if any(isinstance(p, ToolReturnPart) for p in last.parts):
            return ModelResponse(parts=[TextPart("Here is what the records say.")])
        question = next(p for p in last.parts if isinstance(p, UserPromptPart))
        args = json.dumps({"item": str(question.content)[-12:]})
        return ModelResponse(parts=[ToolCallPart("lookup", args, tool_call_id=f"c{len(seen)}")])

    history = KeelHistory("gpt-4o", budget=BUDGET)
    agent = Agent(
        FunctionModel(model),
        system_prompt="You look things up.",
        capabilities=[history.capability()],
    )

    @agent.tool_plain
    def lookup(item: str) -> str:
        """Look an item up.

        Args:
            item: what to look up.
        """
        return f"records for {item}: " + "a long line of details about it " * 60

    messages: list[ModelMessage] = []
    for turn in range(40):
        result = await agent.run(f"Turn {turn}: what do we know about item {turn:04d}?",
                                 message_history=messages)  # fmt: skip
        assert result.output == "Here is what the records say."
        messages = result.all_messages()
        assert not _orphans(messages), "the kept history has an orphan"

    limit = history.engine.budget.limit
    assert len(seen) == 80
    for request in seen:
        assert not _orphans(request)
        assert _tokens(request) <= limit
        first = request[0]
        assert isinstance(first, ModelRequest)
        assert isinstance(first.parts[0], SystemPromptPart), "the system prompt stays first"
        assert first.parts[0].content == "You look things up."
    late = seen[-1]
    summaries = [
        p
        for m in late
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, SystemPromptPart) and p.content.startswith(SUMMARY_MARK)
    ]
    assert len(summaries) == 1, "older turns fold into one running summary"
    assert "Turn 0:" not in str(late), "the oldest turn left the window"
    assert "Turn 39:" in str(late), "the current turn is always sent"


_RULES = "Answer from the records only; cite the item number; never guess a date. " * 100
_LOOKUP = "Each record lists an item, its owner, where it is kept and when it was last checked. "
_TODAY = "Today is 2026-12-04; the records were last synced an hour ago, from the warehouse. " * 70
"""A dynamic instruction as long as the static one: leaving either out of the count shows."""


async def test_instructions_and_tool_definitions_count_in_the_budget() -> None:
    """About 1,600 tokens of static ``instructions``, as many of dynamic ones and a tool
    definition of about 1,000 are sent with every request besides the history: counted, each
    request still fits (one part left out of the count sends 1,600 tokens over)."""
    sent: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        assert info.instructions is not None and _RULES.strip() in info.instructions
        assert _TODAY.strip() in info.instructions
        sent.append(_tokens(messages, info))
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        if any(isinstance(p, ToolReturnPart) for p in last.parts):
            return ModelResponse(parts=[TextPart("Here is what the records say.")])
        return ModelResponse(parts=[ToolCallPart("lookup", '{"item": "x"}', tool_call_id="c")])

    history = KeelHistory("gpt-4o", budget=ContextBudget(working_budget=5_600))
    agent = Agent(FunctionModel(model), instructions=_RULES, capabilities=[history.capability()])

    @agent.instructions
    def today() -> str:
        return _TODAY

    @agent.tool_plain(description="Look an item up in the records. " + _LOOKUP * 50)
    def lookup(item: str) -> str:
        return f"records for {item}: " + "a long line of details about it " * 40

    messages: list[ModelMessage] = []
    for turn in range(30):
        result = await agent.run(f"Turn {turn}: what about item {turn:04d}?",
                                 message_history=messages)  # fmt: skip
        messages = result.all_messages()
    limit = history.engine.budget.limit
    assert len(sent) == 60
    over = [tokens for tokens in sent if tokens > limit]
    assert over == [], f"{len(over)} of {len(sent)} requests over {limit} (max {max(sent)})"


_FIELD = "One line of the report, in the words of the records, with the item number cited. "


class _Report(BaseModel):
    """The answer's shape: its JSON schema (about 1,500 tokens) is sent as instructions."""

    summary: str = Field(description=_FIELD * 25)
    details: str = Field(description=_FIELD * 25)
    sources: str = Field(description=_FIELD * 25)


async def test_a_prompted_outputs_schema_counts_in_the_budget() -> None:
    """``PromptedOutput`` states its schema in the instructions pydantic-ai renders after
    the capability has run: counted all the same."""
    sent: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        assert info.instructions is not None and "sources" in info.instructions
        sent.append(_tokens(messages, info))
        report = {"summary": "fine", "details": "all in stock", "sources": "item 1"}
        return ModelResponse(parts=[TextPart(json.dumps(report))])

    history = KeelHistory("gpt-4o", budget=ContextBudget(working_budget=3_000))
    agent = Agent(
        FunctionModel(model),
        output_type=PromptedOutput(_Report),
        capabilities=[history.capability()],
    )
    messages: list[ModelMessage] = []
    for turn in range(25):
        question = f"Turn {turn}: report on item {turn:04d}. " + "Context for it. " * 40
        result = await agent.run(question, message_history=messages)
        messages = result.all_messages()
    limit = history.engine.budget.limit
    over = [tokens for tokens in sent if tokens > limit]
    assert over == [], f"{len(over)} of {len(sent)} requests over {limit} (max {max(sent)})"
