"""The application's agent a service serves: an [`Agent`][], or a factory
that builds one, found by a ``module:attribute`` spec as ``uvicorn main:app`` finds its app.

The agent (or each agent a factory builds) is the definition of what is served: its model,
system prompt, tools, rules, workflow, guards and options. The service places it on its own
stores, one agent per tenant, as [`ServiceAgents`][] does for ``--model``:
the stores a factory opened for its agent (``Agent.open(settings, ...)``) are closed again.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from keel.errors import ConfigError, UsageError
from keel.runtime import Agent

if TYPE_CHECKING:
    from keel.settings import Settings
    from keel.stores import Backends
    from keel.tools import MCPServer, Tool

__all__ = ["AgentFactory", "AgentSource", "definition_tools", "load_agent", "served_agent"]

AgentFactory: TypeAlias = Callable[[], Agent] | Callable[["Settings"], Agent]
"""A function that builds the application's agent: ``factory()``, or ``factory(settings)``
given the service's [`Settings`][keel.settings.Settings] (its database, model, keys)."""

_EXAMPLE = "examples.ecommerce_support:build"


def load_agent(spec: str) -> Agent | Callable[..., Any]:
    """The object ``module:attribute`` names, the current directory first on ``sys.path``.

    Raises:
        UsageError: the spec is not ``module:attribute``, or names no module or attribute.
        ConfigError: importing the module raised.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name.strip() or not attribute.strip():
        raise UsageError(f"--agent {spec!r}: write MODULE:ATTRIBUTE, e.g. {_EXAMPLE}")
    here = str(Path.cwd())
    if here not in sys.path:
        # As uvicorn and `fastapi run` do: the application's modules are found from here.
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UsageError(
                f"--agent {spec!r}: no module {module_name!r} (looked in {here} and the "
                "installed packages)"
            ) from None
        raise ConfigError(f"--agent {spec!r}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"--agent {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UsageError(
                f"--agent {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        found = getattr(found, part)
    if isinstance(found, type):
        raise UsageError(
            f"--agent {spec!r}: {attribute} is a class; name an Agent or a function that "
            "returns one"
        )
    if isinstance(found, Agent) or callable(found):
        return found  # type: ignore[no-any-return]
    raise UsageError(
        f"--agent {spec!r}: {attribute} is of type {type(found).__name__}, not an Agent or a "
        "function that returns one"
    )


@dataclass
class AgentSource:
    """Where a service's agents come from: one agent, or a factory called once per tenant.

    Args:
        target: an [`Agent`][keel.Agent], or a factory called as ``factory()`` or
            ``factory(settings)``.
        label: how messages name it (the ``--agent`` spec).
    """

    target: Agent | Callable[..., Any]
    label: str = "the agent"
    _built: list[Agent] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.target, Agent):
            return
        if not callable(self.target):
            raise UsageError(f"{self.label}: not an Agent or a function that returns one")
        try:
            parameters = inspect.signature(self.target).parameters.values()
        except (TypeError, ValueError):
            return
        required = [
            p
            for p in parameters
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) > 1:
            raise UsageError(
                f"{self.label}: a factory takes no argument or the settings, not "
                f"{len(required)} ({', '.join(p.name for p in required)})"
            )

    @property
    def per_tenant(self) -> bool:
        """Whether each tenant's agent is built by its own factory call."""
        return not isinstance(self.target, Agent)

    def _takes_settings(self) -> bool:
        if isinstance(self.target, Agent):
            return False
        try:
            parameters = list(inspect.signature(self.target).parameters.values())
        except (TypeError, ValueError):
            return True
        return any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
            for p in parameters
        )

    def build(self, settings: Settings) -> Agent:
        """One agent from the source: the agent itself, or a new one from the factory.

        Raises:
            ConfigError: the factory raised.
            UsageError: the factory returned something other than an Agent.
        """
        if isinstance(self.target, Agent):
            return self.target
        factory = self.target
        try:
            built = factory(settings) if self._takes_settings() else factory()
        except Exception as exc:
            raise ConfigError(
                f"{self.label}: the factory raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(built, Agent):
            raise UsageError(
                f"{self.label}: the factory returned a value of type {type(built).__name__}, "
                "not an Agent"
            )
        return built

    def check(self, settings: Settings) -> Agent:
        """Build once now, so that a factory that fails does so before anything is served;
        the agent is kept for the first tenant (and returned).

        Raises:
            ConfigError: the factory raised.
            UsageError: the factory returned something other than an Agent.
        """
        if not self._built:
            self._built.append(self.build(settings))
        return self._built[0]

    def agent_for(self, tenant_id: str, backends: Backends, settings: Settings) -> Agent:
        """The tenant's agent: the source's definition on the service's stores."""
        template = self._built.pop() if self._built else self.build(settings)
        try:
            return served_agent(template, backends, tenant_id)
        finally:
            if self.per_tenant and template.backends is not None:
                # The stores the factory opened: the service's own serve this agent.
                template.backends.close()


def definition_tools(template: Agent) -> list[Tool | MCPServer]:
    """The tools ``template`` was given: its Python tools and its MCP servers."""
    workflow = template._workflow
    return [*workflow._own.values(), *workflow.servers]


def served_agent(template: Agent, backends: Backends, tenant_id: str) -> Agent:
    """``template``'s definition (model, prompt, tools, rules, workflow, guards, options) as an
    agent of ``tenant_id`` on ``backends``."""
    # The tools as given to the template (Python tools and MCP servers, shared: started by the
    # first agent to run a turn, stopped by the last to close).
    tools = definition_tools(template)
    options: dict[str, Any] = {}
    if template.approvals is not None:
        options["approvals"] = dataclasses.replace(template.approvals, store=backends.approvals)
    return type(template).on_backends(
        backends,
        template.model,
        system_prompt=template.system_prompt,
        tools=tools,
        rules=template.rules,
        machine=template.machine,
        context=template.engine.budget_config,
        guards=template.guards,
        memory_budget_tokens=template.memory_budget_tokens,
        masker=template.masker,
        model_sees=template.model_sees,
        tenant_id=tenant_id,
        name=template.name,
        lease_ttl_s=template.lease_ttl_s,
        session_wait_s=template.session_wait_s,
        output_type=template.output_type,
        model_options=template.model_options,
        **options,
    )
