"""The workflow inside a turn: the model moves the agent's state machine with the ``go_to`` and
``remember`` tools (structured calls, never regexes on prose), and only the current state's
domain tools may run."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from keel.errors import UsageError
from keel.messages import ToolCall
from keel.privacy import maskable_json
from keel.runtime._events import AgentEvent, WorkflowTransition
from keel.state import MachinePosition, StateMachine
from keel.tools import MCPServer, Tool, ToolRegistry, ToolResult, tool
from keel.tools._mcp import AgentServers

__all__ = ["WORKFLOW_TOOLS", "Workflow", "WorkflowCursor"]

WORKFLOW_TOOLS = ("go_to", "remember")


@dataclass
class WorkflowCursor:
    """Where one turn's workflow stands: moved by its tools, checkpointed by the turn."""

    position: MachinePosition | None
    checkpointed: MachinePosition | None = None
    """The position the last checkpoint holds."""
    transitions: list[tuple[str, str]] = field(default_factory=list)
    """Transitions since the last step was traced."""
    emit: Callable[[AgentEvent], None] | None = None

    def __post_init__(self) -> None:
        self.checkpointed = self.position

    def fingerprint(self) -> str:
        position = self.position.model_dump_json() if self.position is not None else ""
        return hashlib.sha256(position.encode()).hexdigest()[:16]


class Workflow:
    """An agent's domain tools (Python ones and those of its MCP servers, as listed now),
    under its state machine when it has one."""

    def __init__(self, machine: StateMachine | None, tools: Iterable[Tool | MCPServer]) -> None:
        given = list(tools)
        self._own = {t.name: t for t in given if isinstance(t, Tool)}
        self.servers = [t for t in given if isinstance(t, MCPServer)]
        # Started on the agent's first turn (``open``), not here: building an agent starts
        # no process; ``Agent.aclose`` lets them go.
        reserved = WORKFLOW_TOOLS if machine is not None else ()
        self.mcp = AgentServers(self.servers, taken=set(self._own), reserved=reserved)
        self.machine = machine
        clash = set(self._own) & set(WORKFLOW_TOOLS)
        if machine is not None and clash:
            raise UsageError(f"tool names {sorted(clash)} are reserved for the workflow")

    @property
    def domain_tools(self) -> dict[str, Tool]:
        """The domain's tools now: the Python ones, then each server's (a name listed later
        by a server under a name already taken is left out)."""
        if not self.servers:
            return self._own
        merged: dict[str, Tool] = dict(self._own)
        for server in self.servers:
            for name, listed in server.tools().items():
                merged.setdefault(name, listed)
        return merged

    def registry(self, cursor: WorkflowCursor) -> ToolRegistry:
        """The turn's tools: the domain's, and the workflow's moving ``cursor``."""
        registry = ToolRegistry()
        for domain_tool in self.domain_tools.values():
            registry.register(domain_tool)
        if self.machine is not None:
            for workflow_tool in self._tools(self.machine, cursor):
                registry.register(workflow_tool)
        return registry

    def refusal(self, position: MachinePosition | None, call: ToolCall) -> str | None:
        """Why the workflow's step ``position`` does not allow ``call`` (None: it does). Asked
        before the call is journalled, so a refused side effect leaves no trace of an intent."""
        machine = self.machine
        if machine is None or position is None or call.name not in self.domain_tools:
            return None
        allowed = machine.tools(position)
        if call.name in allowed:
            return None
        return (
            f"{call.name} is not allowed in step {position.state!r} "
            f"(allowed: {', '.join(allowed) or 'none'}); move the workflow on with go_to first"
        )

    def rules(self, position: MachinePosition | None) -> list[str]:
        """The operating rules of step ``position``: where the workflow is, what not to call."""
        if self.machine is None or position is None:
            return []
        rules = [self.machine.resume_prompt(position)]
        allowed = set(self.machine.tools(position))
        banned = sorted(name for name in self.domain_tools if name not in allowed)
        if banned:
            rules.append(f"Do not call these tools in this step: {', '.join(banned)}.")
        rules.append(
            "To record a detail the user gave, call remember(slot, value). To move the "
            "workflow on, call go_to(step) with one of the possible next steps."
        )
        return rules

    def ran_effect(self, result: ToolResult) -> bool:
        """Whether ``result`` is of a side-effecting domain tool that ran (now or before a
        crash) or may have run."""
        declared = self.domain_tools.get(result.tool)
        if declared is None or not declared.side_effect:
            return False
        return (
            result.ok
            or result.status in ("in_doubt", "timeout")
            or (result.status == "failed" and result.executed)
        )

    @staticmethod
    def _tools(machine: StateMachine, cursor: WorkflowCursor) -> list[Tool]:
        def go_to(step: str) -> str:
            """Move the workflow to its next step.

            Args:
                step: One of the possible next steps listed in the instructions.
            """
            position = cursor.position or machine.start()
            moved = machine.transition(position, step)
            cursor.transitions.append((position.state, moved.state))
            cursor.position = moved
            if cursor.emit is not None and moved.state != position.state:
                cursor.emit(WorkflowTransition(source=position.state, target=moved.state))
            return json.dumps({"step": moved.state, "next": machine.allowed(moved)})

        def remember(slot: str, value: str) -> str:
            """Record a detail the user gave (origin, destination, dates, passengers, ...).

            Args:
                slot: The name of the detail.
                value: Its value, as the user gave it.
            """
            position = cursor.position or machine.start()
            cursor.position = machine.fill(position, **{slot: value})
            return maskable_json({"remembered": {slot: value}}, sort_keys=False)

        # Slots are state, stored as they are: they keep the user's placeholders, never values.
        keep_placeholders = tool(sees_values=False)
        return [keep_placeholders(go_to), keep_placeholders(remember)]
