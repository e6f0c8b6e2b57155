"""``@tool``: a typed Python function becomes a tool a model can call.

The function's signature becomes a Pydantic model (the arguments' validator) and a JSON schema
in the OpenAI ``tools`` format; the docstring's summary becomes the description and its
Google-style ``Args:`` section (or ``Annotated[..., Field(description=...)]``) the per-field
descriptions. Side effects are declared, because exactly-once execution depends on them.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
import inspect
import json
import logging
import re
import sys
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeAlias, overload

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo
from typing_extensions import TypeVar

from keel._bridge import run_in_thread
from keel.errors import ToolDefinitionError

__all__ = [
    "ApprovalNeed",
    "ApprovalPolicy",
    "NestedArgumentsWarning",
    "Tool",
    "ToolContext",
    "ToolScope",
    "tool",
]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ARGS_HEADERS = ("args:", "arguments:", "parameters:")
_SECTION_HEADERS = (
    "returns:",
    "return:",
    "raises:",
    "yields:",
    "examples:",
    "example:",
    "notes:",
    "note:",
)

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger("keel.tools")

# A default, so a bare ``ToolContext`` annotation stays valid under strict type checking.
DepsT = TypeVar("DepsT", default=Any)


class NestedArgumentsWarning(UserWarning):
    """A tool's arguments are nested objects; small models often fail to fill them."""


@dataclass(frozen=True)
class ToolContext(Generic[DepsT]):
    """What keel knows about the current call; a tool receives it by declaring a parameter
    (``context: ToolContext`` or ``context: ToolContext[MyDeps]``), never shown to the model.

    A side-effecting tool can pass ``idempotency_key`` to the system it calls (a payment or
    booking API), so that even an in-doubt retry done by an operator cannot act twice.
    ``deps`` is what the caller gave the turn (``agent.run(..., deps=...)``): the tool's
    database handle or API client, so tools need not be closures.
    """

    session_id: str
    step: int
    call_index: int
    call_id: str
    idempotency_key: str
    attempt: int = 1
    user_id: str | None = None
    """The user whose turn it is (set by an Agent)."""
    tenant_id: str | None = None
    """The tenant the turn is scoped to (set by an Agent)."""
    run_id: str | None = None
    """The run's trace id (set by an Agent)."""
    deps: DepsT = None  # type: ignore[assignment]  # None when the turn was given none
    """The turn's dependencies, as given to ``run`` / ``stream`` (None when none were)."""


@dataclass(frozen=True)
class ToolScope:
    """Who a loop's tool calls run for: copied into each call's [`ToolContext`][]."""

    user_id: str | None = None
    tenant_id: str | None = None
    run_id: str | None = None
    deps: Any = None


@dataclass(frozen=True)
class ApprovalNeed:
    """What a tool's approval policy asks of one call: who decides (the session's ``user``
    confirms, or an ``operator`` approves), why, and how long the request may wait (None:
    the agent's default)."""

    kind: Literal["user", "operator"] = "operator"
    reason: str = ""
    expires_after_s: float | None = None


ApprovalPolicy: TypeAlias = (
    "bool | Literal['user', 'operator'] | Callable[[BaseModel, ToolContext], ApprovalNeed | None]"
)
"""``True`` (an operator approves every call), ``"user"`` / ``"operator"``, or a callable of
the validated arguments and the call's context that decides per call (None: no approval)."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: its name, description, argument model, schema and declared effects.

    Build one with [`tool`][]; call [`ainvoke`][] with validated arguments.
    """

    name: str
    description: str
    function: Callable[..., Any]
    args_model: type[BaseModel]
    side_effect: bool = False
    idempotent: bool = True
    timeout_s: float | None = None
    max_output_chars: int | None = None
    context_parameter: str | None = None
    nested_fields: tuple[str, ...] = field(default=())
    sees_values: bool = True
    """With a PII vault: placeholders in the arguments are resolved to the user's values
    before the call (False: the tool gets the placeholders)."""
    masked_arguments: tuple[str, ...] = ()
    """Top-level arguments that keep their placeholders even for a tool that sees values."""
    blocking: bool = True
    """A sync function that may block (I/O, a wait) runs in a thread of its own; False: it
    returns at once, and runs on the event loop as an async tool does (see [`tool`][])."""

    approval: ApprovalPolicy | None = None
    waiting_message: str | None = None
    """What the customer reads while a call of this tool waits for a decision (None: keel's
    default, written for a customer)."""

    def approval_need(self, arguments: BaseModel, context: ToolContext) -> ApprovalNeed | None:
        """Whether this call waits for a person before it runs (see [`tool`][])."""
        policy = self.approval
        if policy is None or policy is False:
            return None
        if policy is True or policy == "operator":
            return ApprovalNeed("operator", f"{self.name} needs an operator's approval")
        if policy == "user":
            return ApprovalNeed("user", f"{self.name} needs the user's confirmation")
        assert callable(policy)
        return policy(arguments, context)

    @functools.cached_property
    def is_async(self) -> bool:
        """True when the function is a coroutine function (run on the event loop); asked at
        every call, answered once (the tool is frozen: its function never changes)."""
        return inspect.iscoroutinefunction(self.function)

    @functools.cached_property
    def _parameters(self) -> dict[str, Any]:
        schema: dict[str, Any] = _strip_titles(self.args_model.model_json_schema())
        return schema

    @functools.cached_property
    def _schema_text(self) -> str:
        """[`schema`][] as JSON text: a registry built for each turn copies it from here."""
        return json.dumps(self.schema(), ensure_ascii=False)

    def parameters_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments (titles removed; they only cost tokens)."""
        return copy.deepcopy(self._parameters)

    def schema(self) -> dict[str, Any]:
        """The tool in the OpenAI ``tools`` format."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters_schema(),
            },
        }

    async def ainvoke(self, arguments: BaseModel, context: ToolContext | None = None) -> Any:
        """Run the function with validated arguments (sync functions run in a thread, unless
        declared not ``blocking``).

        A sync function that hangs cannot be interrupted by a timeout: the caller stops
        waiting, but the thread runs on. It is a daemon thread of its own
        (`keel._bridge.run_in_thread`: reused once idle, never one that is busy), not the
        bounded blocking pool, so hung tools neither starve other work of threads nor keep
        ``asyncio.run`` (and the process) from ending. When such a thread finishes after all,
        its outcome goes to `abandoned_result` (the executor journals it for side-effecting
        calls). Prefer async tools for anything that may hang.
        """
        kwargs = {name: getattr(arguments, name) for name in type(arguments).model_fields}
        if self.context_parameter is not None:
            kwargs[self.context_parameter] = context
        if self.is_async:
            return await self.function(**kwargs)
        if not self.blocking:
            # Declared quick: the hand-off to a thread and back would cost more than the call.
            result = self.function(**kwargs)
        else:
            result = await run_in_thread(
                functools.partial(self.function, **kwargs), on_abandoned=abandoned_result.get()
            )
        if inspect.isawaitable(result):
            return await result
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly, as if it were not a tool."""
        return self.function(*args, **kwargs)


@overload
def tool(function: F, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: bool = False,
    idempotent: bool | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
    sees_values: bool = True,
    masked_arguments: tuple[str, ...] = (),
    approval: ApprovalPolicy | None = None,
    waiting_message: str | None = None,
    blocking: bool = True,
) -> Callable[[F], Tool]: ...


def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: bool = False,
    idempotent: bool | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
    sees_values: bool = True,
    masked_arguments: tuple[str, ...] = (),
    approval: ApprovalPolicy | None = None,
    waiting_message: str | None = None,
    blocking: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (sync or async) into a [`Tool`][].

    Use it bare (``@tool``) or with options:

    ```python
    @tool(side_effect=True, idempotent=False, timeout_s=10)
    async def book_flight(flight: str, passengers: int) -> str:
        \"\"\"Book seats on a flight.

        Args:
            flight: The flight number, e.g. "AF123".
            passengers: How many seats to book.
        \"\"\"
    ```

    Args:
        name: the tool's name for the model (default: the function's name).
        description: overrides the docstring's summary.
        side_effect: the tool changes the world (books, pays, sends). Side-effecting calls are
            journalled and run at most once per (session, step, call), across crashes.
        idempotent: running it twice has the same effect as once. Defaults to
            ``not side_effect``. Decides what happens to an in-doubt call after a crash: an
            idempotent tool runs again; any other surfaces a ``ToolInDoubtError``.
        timeout_s: per-call wall-clock limit (default: the executor's).
        max_output_chars: output longer than this is truncated for the model (default: the
            executor's); the whole output stays in the result for traces.
        sees_values: with a PII vault (``Agent(vault=...)``), placeholders such as
            ``<EMAIL_1>`` in the call's arguments are replaced by the user's real values
            before the arguments are validated and the tool runs. False: the tool gets the
            placeholders (one that must never see personal data), and a value the model
            wrote itself masked, where keel has a masker.
        masked_arguments: names of top-level arguments that keep their placeholders even for a
            tool that sees values (secrets it passes on without reading).
        approval: the call waits for a person before it runs: ``True`` or ``"operator"``
            (an operator approves), ``"user"`` (the user confirms), or a policy
            ``(arguments, context) -> ApprovalNeed | None`` deciding per call (a refund over
            500). Such a tool is side-effecting (journalled, run once) unless said otherwise.
        waiting_message: what the customer reads while a call waits for that decision
            (default: keel's own sentence for a customer; the detail stays in the request).
        blocking: False declares a sync function that returns at once (no I/O, no waiting, a
            pure computation): it runs on the event loop, as an async tool does, sparing each
            call the hand-off to a thread and back (tens of microseconds, far more on a loaded
            machine). Like an async tool that never awaits, its timeout cannot stop it
            midway; it is journalled and run once all the same. Async functions ignore it.

    Raises:
        ToolDefinitionError: the function cannot be described as a tool (``*args``, a
            parameter without a type annotation, an invalid name).
    """

    # A call a person must approve is consequential: journalled, so it runs once.
    side_effect = side_effect or approval not in (None, False)

    def build(fn: Callable[..., Any]) -> Tool:
        if not isinstance(blocking, bool):
            raise ToolDefinitionError(f"tool {fn.__name__!r}: blocking must be True or False")
        built = _build_tool(
            fn,
            name=name,
            description=description,
            side_effect=side_effect,
            idempotent=(not side_effect) if idempotent is None else idempotent,
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
            sees_values=sees_values,
            masked_arguments=masked_arguments,
        )
        checked = check_approval(built.name, approval)
        waiting = check_waiting_message(built.name, checked, waiting_message)
        return dataclasses.replace(
            built, approval=checked, waiting_message=waiting, blocking=blocking
        )

    if function is not None:
        return build(function)
    return build


def check_approval(name: str, approval: ApprovalPolicy | None) -> ApprovalPolicy | None:
    """A tool's approval policy once it is one keel can apply (None or False: none).

    Raises:
        ToolDefinitionError: not True, ``"user"``, ``"operator"`` or a policy callable.
    """
    if approval is None or approval is False:
        return None
    if not (approval in (True, "user", "operator") or callable(approval)):
        raise ToolDefinitionError(
            f"tool {name!r}: approval must be True, 'user', 'operator' or a policy callable, "
            f"not {approval!r}"
        )
    return approval


def check_waiting_message(
    name: str, approval: ApprovalPolicy | None, waiting_message: str | None
) -> str | None:
    """A tool's waiting message once it is one keel can show (None: keel's default).

    Raises:
        ToolDefinitionError: not text, blank, or given to a tool that waits for nobody.
    """
    if waiting_message is None:
        return None
    if not isinstance(waiting_message, str) or not waiting_message.strip():
        raise ToolDefinitionError(f"tool {name!r}: waiting_message must be non-empty text")
    if approval is None:
        raise ToolDefinitionError(
            f"tool {name!r}: waiting_message is shown while a call waits for approval, and "
            "this tool has no approval= policy"
        )
    return waiting_message.strip()


def _build_tool(
    fn: Callable[..., Any],
    *,
    name: str | None,
    description: str | None,
    side_effect: bool,
    idempotent: bool,
    timeout_s: float | None,
    max_output_chars: int | None,
    sees_values: bool = True,
    masked_arguments: tuple[str, ...] = (),
) -> Tool:
    tool_name = _checked_name(fn, name)
    if timeout_s is not None and timeout_s <= 0:
        raise ToolDefinitionError(f"tool {tool_name!r}: timeout_s must be positive")
    if max_output_chars is not None and max_output_chars < 1:
        raise ToolDefinitionError(f"tool {tool_name!r}: max_output_chars must be at least 1")
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    fields, context_parameter = _argument_fields(fn, tool_name, arg_docs)
    unknown = sorted(set(masked_arguments) - set(fields))
    if unknown:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: masked_arguments names arguments it does not take: {unknown}"
        )
    try:
        args_model: type[BaseModel] = create_model(
            _model_name(tool_name),
            __config__=ConfigDict(extra="forbid"),
            **fields,
        )
        raw_schema = args_model.model_json_schema()
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: its arguments cannot be turned into a JSON schema: {exc}"
        ) from exc
    text = (description if description is not None else summary).strip()
    if not text:
        raise ToolDefinitionError(
            f"tool {tool_name!r} has no description: give the function a docstring "
            "(models choose tools by their descriptions)"
        )
    nested = _nested_fields(raw_schema)
    built = Tool(
        name=tool_name,
        description=text,
        function=fn,
        args_model=args_model,
        side_effect=side_effect,
        idempotent=idempotent,
        timeout_s=timeout_s,
        max_output_chars=max_output_chars,
        context_parameter=context_parameter,
        nested_fields=tuple(nested),
        sees_values=sees_values,
        masked_arguments=tuple(masked_arguments),
    )
    built.__dict__["_parameters"] = _strip_titles(raw_schema)  # seeds the cached_property
    if nested:
        warnings.warn(
            NestedArgumentsWarning(_nested_advice(built, nested)),
            stacklevel=4,
        )
    return built


def _checked_name(fn: Callable[..., Any], name: str | None) -> str:
    """The tool's name for the model, once ``fn`` is known to be a function that can be one."""
    if isinstance(fn, Tool):
        raise ToolDefinitionError(f"{fn.name!r} is already a tool")
    if not callable(fn):
        raise ToolDefinitionError(f"@tool needs a function, got {type(fn).__name__}")
    tool_name: str = name or str(getattr(fn, "__name__", ""))
    if not _NAME.match(tool_name):
        raise ToolDefinitionError(
            f"tool name {tool_name!r} is invalid: use 1-64 letters, digits, '_' or '-'"
        )
    return tool_name


def _argument_fields(
    fn: Callable[..., Any], tool_name: str, arg_docs: dict[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The argument model's fields, one per parameter the model fills (described by the
    docstring's ``Args:``), and the parameter that receives the [`ToolContext`][]."""
    try:
        hints = _type_hints(fn)
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: cannot resolve its type annotations: {exc}"
        ) from exc
    fields: dict[str, Any] = {}
    context_parameter: str | None = None
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"tool {tool_name!r}: *{parameter.name} / **{parameter.name} cannot be "
                "described to a model; declare each argument"
            )
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"tool {tool_name!r}: positional-only parameter {parameter.name!r}; "
                "tools are called with keyword arguments"
            )
        if parameter.name not in hints:
            raise ToolDefinitionError(
                f"tool {tool_name!r}: parameter {parameter.name!r} has no type annotation"
            )
        annotation = hints[parameter.name]
        if _is_context(annotation):
            context_parameter = parameter.name
            continue
        default = ... if parameter.default is parameter.empty else parameter.default
        doc = arg_docs.get(parameter.name)
        if isinstance(default, FieldInfo):
            fields[parameter.name] = (annotation, default)
        elif doc and not _annotated_description(annotation):
            fields[parameter.name] = (annotation, Field(default, description=doc))
        else:
            fields[parameter.name] = (annotation, default)
    return fields, context_parameter


AbandonedResult = Callable[[bool, Any], None]
"""Called with ``(ok, value)`` when a sync tool finishes after its caller stopped waiting."""

abandoned_result: contextvars.ContextVar[AbandonedResult | None] = contextvars.ContextVar(
    "keel_abandoned_result", default=None
)
"""Set by the executor around a journalled call: a thread that outlives its timeout (or the
cancelled run) still reports what really happened, so the journal can record it. A context
variable rather than a parameter, so that wrappers of ``ainvoke`` (the Agent's workflow gate)
carry it without knowing about it."""


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations; string annotations may name classes local to the caller.

    With ``from __future__ import annotations`` every annotation is a string, and a class
    defined inside a function is invisible to ``get_type_hints``: the frames that called
    ``@tool`` are searched for it.
    """
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except NameError:
        localns: dict[str, Any] = {}
        frame: types.FrameType | None = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                break
            for name, value in frame.f_locals.items():
                localns.setdefault(name, value)
            frame = frame.f_back
        return typing.get_type_hints(fn, localns=localns, include_extras=True)


def _model_name(tool_name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[_-]", tool_name)) + "Arguments"


def _annotated_description(annotation: Any) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:
        return any(
            isinstance(extra, FieldInfo) and extra.description
            for extra in typing.get_args(annotation)[1:]
        )
    return False


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (everything before the first section) and the ``Args:`` entries."""
    summary_lines: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        lowered = stripped.lower()
        if lowered in _ARGS_HEADERS:
            section, current, arg_indent = "args", None, None
            continue
        if lowered in _SECTION_HEADERS:
            section, current = "other", None
            continue
        if section is None:
            summary_lines.append(line)
        elif section == "args" and stripped:
            indent = len(line) - len(line.lstrip())
            match = re.match(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if match and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1).lstrip("*")
                args[current] = match.group(2).strip()
            elif current is not None:
                args[current] = f"{args[current]} {stripped}".strip()
    summary = "\n".join(summary_lines).strip()
    return summary, args


def _strip_titles(schema: Any) -> Any:
    """A copy of ``schema`` without the ``title`` keywords Pydantic adds."""
    if isinstance(schema, dict):
        cleaned: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "title" and isinstance(value, str):
                continue
            if key in ("properties", "$defs") and isinstance(value, dict):
                cleaned[key] = {name: _strip_titles(sub) for name, sub in value.items()}
            else:
                cleaned[key] = _strip_titles(value)
        return cleaned
    if isinstance(schema, list):
        return [_strip_titles(item) for item in schema]
    return schema


def _nested_fields(schema: dict[str, Any]) -> list[str]:
    nested: list[str] = []
    for name, prop in schema.get("properties", {}).items():
        if _is_object_schema(prop, schema):
            nested.append(name)
    return nested


def _is_object_schema(prop: Any, root: dict[str, Any]) -> bool:
    if not isinstance(prop, dict):
        return False
    if "$ref" in prop:
        return True
    if prop.get("type") == "object":
        return True
    if prop.get("type") == "array":
        return _is_object_schema(prop.get("items"), root)
    return any(_is_object_schema(option, root) for option in prop.get("anyOf", []))


def _nested_advice(built: Tool, nested: list[str]) -> str:
    """The warning text: which arguments are nested, and the flat signature to use instead."""
    schema = built.args_model.model_json_schema()
    defs = schema.get("$defs", {})
    flat: list[str] = []
    for name, prop in schema.get("properties", {}).items():
        if name not in nested:
            flat.append(f"{name}: {_json_type(prop)}")
            continue
        inner = _resolve_object(prop, defs)
        if inner is None:
            flat.append(f"{name}_json: str")
            continue
        many = prop.get("type") == "array"
        for inner_name, inner_prop in inner.get("properties", {}).items():
            inner_type = _json_type(inner_prop)
            flat.append(f"{name}_{inner_name}: {f'list[{inner_type}]' if many else inner_type}")
    return (
        f"tool {built.name!r} takes nested object arguments ({', '.join(nested)}); small models "
        "often fail to fill nested JSON. Prefer flat arguments, e.g. "
        f"def {built.name}({', '.join(flat)})"
    )


def _resolve_object(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    if prop.get("type") == "array":
        items = prop.get("items")
        return _resolve_object(items, defs) if isinstance(items, dict) else None
    if "$ref" in prop:
        target = defs.get(str(prop["$ref"]).rsplit("/", 1)[-1])
        return target if isinstance(target, dict) else None
    for option in prop.get("anyOf", []):
        if isinstance(option, dict) and option.get("type") != "null":
            return _resolve_object(option, defs)
    if prop.get("type") == "object" and "properties" in prop:
        return prop
    return None


def _json_type(prop: Any) -> str:
    names = {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}
    if not isinstance(prop, dict):
        return "str"
    if prop.get("type") in names:
        return names[str(prop["type"])]
    if prop.get("type") == "array":
        return f"list[{_json_type(prop.get('items'))}]"
    if "enum" in prop:
        return "str"
    options = [o for o in prop.get("anyOf", []) if isinstance(o, dict) and o.get("type") != "null"]
    if len(options) == 1:
        return f"{_json_type(options[0])} | None"
    return "str"


def _is_context(annotation: Any) -> bool:
    """``ToolContext``, ``ToolContext[Deps]``, or either ``| None``."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else ()
    candidates = [option for option in options if option is not type(None)] or [annotation]
    return len(candidates) == 1 and (
        candidates[0] is ToolContext or typing.get_origin(candidates[0]) is ToolContext
    )
