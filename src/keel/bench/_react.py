"""LangGraph's prebuilt ReAct agent on a given checkpointer, with a chat model that plays a fixed
policy (a tool call, then the answer): the workload ``keel bench turns`` and ``keel bench
integrations`` run through LangGraph."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["ANSWER", "question", "react_agent", "tool_output"]

ANSWER = "Here is what I found: " + "the answer in a few plain words " * 3


def question(turn: int) -> str:
    return f"Question {turn}: what do the records say about item {turn % 97}?"


def tool_output(query: str) -> str:
    return f"records for {query}: " + "one entry with its details " * 6


def react_agent(checkpointer: Any) -> tuple[Any, dict[str, int]]:
    """The compiled agent, and the count of the tool's executions (kept by the tool itself)."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.tools import tool as lc_tool
    from langgraph.prebuilt import create_react_agent

    executions = {"count": 0}

    @lc_tool
    def lookup(query: str) -> str:
        """Look records up."""
        executions["count"] += 1
        return tool_output(query)

    class PolicyChatModel(BaseChatModel):
        """A tool call, then the answer (the policy of keel's scripted bench model)."""

        calls: int = 0

        @property
        def _llm_type(self) -> str:
            return "keel-bench-policy"

        def bind_tools(self, tools: Any, **kwargs: Any) -> PolicyChatModel:
            return self

        def _generate(
            self,
            messages: list[BaseMessage],
            stop: list[str] | None = None,
            run_manager: Any = None,
            **kwargs: Any,
        ) -> ChatResult:
            self.calls += 1
            last = messages[-1]
            if isinstance(last, ToolMessage):
                reply = AIMessage(content=ANSWER)
            else:
                query = str(last.content)[-24:]
                reply = AIMessage(
                    content="",
                    tool_calls=[
                        {"name": "lookup", "args": {"query": query}, "id": f"call_{self.calls}"}
                    ],
                )
            return ChatResult(generations=[ChatGeneration(message=reply)])

    # Deprecated in LangGraph 1.0 for langchain's create_agent (another package); it is still
    # LangGraph's own ReAct agent, the graph its users run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        graph = create_react_agent(PolicyChatModel(), [lookup], checkpointer=checkpointer)
    return graph, executions
