"""A tool's text that spells a placeholder is not the user's value (issue 44, item 11), through
each framework's own runner on keel's store: alice stored her card (``<CREDIT_CARD_1>`` in her
vault), then a tool returns the literal text ``<CREDIT_CARD_1>``. What the framework reads back
holds her card where she wrote it, and nowhere in the tool's output: the adapter defangs
placeholder-shaped text a tool returned before masking it, so a read never reveals it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.messages import ModelResponse as PydanticResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from keel.integrations.langgraph import KeelCheckpointSaver
from keel.integrations.openai_agents import KeelSession
from keel.integrations.pydantic_ai import KeelMessageStore
from keel.privacy import MasterKey, Vault
from keel.stores import SQLiteDatabase, SQLiteVaultStore

CARD = "4111 1111 1111 1111"
CARD_DIGITS = "4111111111111111"
FORGED = "<CREDIT_CARD_1>"
"""What the tool writes: the very placeholder alice's card has in her vault."""
TOOL_SAYS = f"card on file: {FORGED}"


@pytest.fixture
def database(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keel.db'}"


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[Vault]:
    with SQLiteDatabase(tmp_path / "keel.db") as sqlite:
        opened = Vault(SQLiteVaultStore(sqlite), MasterKey.generate())
        opened.check()
        yield opened


def _holds_the_card(text: str) -> bool:
    return CARD in text or CARD_DIGITS in text.replace(" ", "")


# --- LangGraph ----------------------------------------------------------------------------------


@tool
def order_status() -> str:
    """The status of the user's order."""
    return TOOL_SAYS


class _Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _assistant(state: _Chat) -> dict[str, Any]:
    """A scripted model: asked about the order, it calls ``order_status``; else it answers."""
    last = state["messages"][-1]
    if isinstance(last, HumanMessage) and "order" in str(last.content):
        call = {"name": "order_status", "args": {}, "id": "call-1"}
        return {"messages": [AIMessage(content="", tool_calls=[call])]}
    return {"messages": [AIMessage(content="Noted.")]}


def _order_graph(saver: KeelCheckpointSaver) -> Any:
    graph = StateGraph(_Chat)
    graph.add_node("assistant", _assistant)
    graph.add_node("tools", ToolNode([order_status]))
    graph.add_edge(START, "assistant")
    graph.add_conditional_edges("assistant", tools_condition)
    graph.add_edge("tools", "assistant")
    return graph.compile(checkpointer=saver)


def test_a_langgraph_tool_message_spelling_the_users_placeholder_reads_back_without_her_card(
    database: str, vault: Vault
) -> None:
    alice = {"configurable": {"thread_id": "t1", "user_id": "alice"}}
    with KeelCheckpointSaver(database, tenant="acme", vault=vault) as saver:
        graph = _order_graph(saver)
        graph.invoke({"messages": [HumanMessage(content=f"My card is {CARD}")]}, alice)
        graph.invoke({"messages": [HumanMessage(content="What is my order's status?")]}, alice)
    # A new saver reads the thread as stored (nothing cached from the writes).
    with KeelCheckpointSaver(database, tenant="acme", vault=vault) as reader:
        messages = _order_graph(reader).get_state(alice).values["messages"]
    assert messages[0].content == f"My card is {CARD}", "the user's own placeholder is revealed"
    [returned] = [m for m in messages if isinstance(m, ToolMessage)]
    assert not _holds_the_card(str(returned.content)), "the tool's text was revealed as her card"
    assert "CREDIT_CARD_1" in str(returned.content), "the tool's text is kept, defanged"


# --- OpenAI Agents SDK --------------------------------------------------------------------------


@function_tool
def lookup_order() -> str:
    """The status of the user's order."""
    return TOOL_SAYS


class _OrderModel(Model):
    """A scripted model: asked about the order, it calls ``lookup_order``; else it answers."""

    async def get_response(
        self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        last = dict(list(input)[-1])
        if last.get("role") == "user" and "order" in str(last.get("content")):
            call = ResponseFunctionToolCall(
                type="function_call", call_id="call-1", name="lookup_order", arguments="{}"
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text="Noted.", annotations=[])
        message = ResponseOutputMessage(
            id="m", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


async def test_an_agents_sdk_tool_output_spelling_the_users_placeholder_reads_back_without_her_card(
    database: str, vault: Vault
) -> None:
    set_tracing_disabled(True)
    agent = Agent(name="shop", model=_OrderModel(), tools=[lookup_order])
    async with KeelSession(
        "conv-1", database=database, tenant="acme", user_id="alice", vault=vault
    ) as session:
        await Runner.run(agent, f"My card is {CARD}", session=session)
        await Runner.run(agent, "What is my order's status?", session=session)
    async with KeelSession(
        "conv-1", database=database, tenant="acme", user_id="alice", vault=vault
    ) as reader:
        items = await reader.get_items()
    assert items[0]["content"] == f"My card is {CARD}", "the user's own placeholder is revealed"
    [returned] = [i for i in items if i.get("type") == "function_call_output"]
    output = json.dumps(returned["output"], ensure_ascii=False)
    assert not _holds_the_card(output), "the tool's output was revealed as her card"
    assert "CREDIT_CARD_1" in output, "the tool's output is kept, defanged"


# --- pydantic-ai --------------------------------------------------------------------------------


def _order_agent() -> PydanticAgent[None, str]:
    """A pydantic-ai agent on a scripted model: asked about the order, it calls
    ``order_status``; else it answers."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> PydanticResponse:
        last = messages[-1]
        asked = isinstance(last, ModelRequest) and any(
            isinstance(part, UserPromptPart) and "order" in str(part.content) for part in last.parts
        )
        if asked:
            return PydanticResponse(parts=[ToolCallPart("order_status", {}, tool_call_id="c1")])
        return PydanticResponse(parts=[TextPart("Noted.")])

    agent = PydanticAgent(FunctionModel(respond))

    @agent.tool_plain
    def order_status() -> str:
        """The status of the user's order."""
        return TOOL_SAYS

    return agent


async def test_a_pydantic_ai_tool_return_spelling_the_users_placeholder_loads_without_her_card(
    database: str, vault: Vault
) -> None:
    agent = _order_agent()
    async with KeelMessageStore(
        "conv-1", database=database, tenant="acme", user_id="alice", vault=vault
    ) as store:
        result = await agent.run(f"My card is {CARD}", message_history=await store.load())
        await store.save(result.all_messages())
        asked = "What is my order's status?"
        result = await agent.run(asked, message_history=await store.load())
        await store.save(result.all_messages())
    async with KeelMessageStore(
        "conv-1", database=database, tenant="acme", user_id="alice", vault=vault
    ) as reader:
        loaded = await reader.load()
    parts = [part for message in loaded for part in message.parts]
    said = [part.content for part in parts if isinstance(part, UserPromptPart)]
    assert said[0] == f"My card is {CARD}", "the user's own placeholder is revealed"
    [returned] = [part for part in parts if isinstance(part, ToolReturnPart)]
    assert not _holds_the_card(str(returned.content)), "the tool's return was revealed as her card"
    assert "CREDIT_CARD_1" in str(returned.content), "the tool's return is kept, defanged"
