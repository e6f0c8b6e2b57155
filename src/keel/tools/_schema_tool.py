"""Tools defined by a JSON schema instead of a Python signature (an MCP server's tools, an
OpenAPI operation): the schema is the contract the model's arguments are validated against.

The same path as ``@tool`` functions: the executor repairs what is safe to repair (code fences,
numbers written as strings where the schema wants numbers), validates, and answers an invalid
call with one ``Field 'x': ...`` line per problem; side effects, timeouts, output caps and the
journal apply unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jsonschema
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from keel.errors import ToolDefinitionError
from keel.tools._tool import (
    _NAME,
    ApprovalPolicy,
    Tool,
    ToolContext,
    check_approval,
    check_waiting_message,
)

__all__ = ["SchemaFunction", "SchemaTool", "schema_tool"]

SchemaFunction = Callable[[dict[str, Any], ToolContext | None], Awaitable[Any]]
"""What a schema tool runs: an async function of (validated arguments, the call's context)."""


class _SchemaArguments(BaseModel):
    """Arguments validated by a JSON schema: every key the schema accepts is kept as given."""

    model_config = ConfigDict(extra="allow")
    validator: ClassVar[Any] = None
    names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def model_validate(cls, obj: Any, **_: Any) -> _SchemaArguments:
        """``obj`` checked against the schema: a ``ValidationError`` with one entry per
        problem (located at its field), as Pydantic reports a typed signature's."""
        problems = [
            detail
            for error in cls.validator.iter_errors(obj)
            for detail in _problems(error, cls.names)
        ]
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return cls.model_construct(**obj)

    def arguments(self) -> dict[str, Any]:
        """The arguments as the function receives them."""
        return dict(self.__pydantic_extra__ or {})


def _problems(error: jsonschema.ValidationError, names: tuple[str, ...]) -> list[InitErrorDetails]:
    """One jsonschema error as Pydantic's error details, each at the field it concerns."""
    location = tuple(error.absolute_path)
    instance = error.instance if isinstance(error.instance, dict) else {}
    if error.validator == "required" and isinstance(error.validator_value, list):
        missing = [name for name in error.validator_value if name not in instance]
        return [_detail((*location, name), "Field required", None) for name in missing[:1]]
    if error.validator == "additionalProperties" and not location:
        valid = ", ".join(names) or "none"
        return [
            _detail((name,), f"not an argument of this tool (valid arguments: {valid})", value)
            for name, value in instance.items()
            if name not in names
        ] or [_detail(("arguments",), error.message, instance)]
    return [_detail(location or ("arguments",), error.message, error.instance)]


def _detail(location: tuple[Any, ...], message: str, value: Any) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("json_schema", "{message}", {"message": message}),
        loc=location,
        input=value,
    )


@dataclass(frozen=True)
class SchemaTool(Tool):
    """A [`Tool`][] whose arguments are described by a JSON schema and whose function is
    ``async def function(arguments: dict, context: ToolContext | None)``."""

    async def ainvoke(self, arguments: BaseModel, context: ToolContext | None = None) -> Any:
        """Run the function with the validated arguments (a dict) and the call's context."""
        values = (
            arguments.arguments()
            if isinstance(arguments, _SchemaArguments)
            else arguments.model_dump()
        )
        return await self.function(values, context)


def schema_tool(
    name: str,
    description: str,
    parameters: Mapping[str, Any],
    function: SchemaFunction,
    *,
    side_effect: bool = False,
    idempotent: bool | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
    sees_values: bool = True,
    masked_arguments: tuple[str, ...] = (),
    approval: ApprovalPolicy | None = None,
    waiting_message: str | None = None,
) -> SchemaTool:
    """A tool from its name, description, the JSON schema of its arguments and an async
    function: the arguments a model writes are validated against ``parameters``.

    Args:
        name: the tool's name for the model (1-64 letters, digits, ``_`` or ``-``).
        description: what the tool does, for the model.
        parameters: a JSON schema of type ``object`` (draft 2020-12 unless ``$schema`` says).
        function: ``async def f(arguments: dict, context: ToolContext | None) -> Any``.
        side_effect / idempotent / timeout_s / max_output_chars: as for
            [`tool`][].
        sees_values / masked_arguments: as for [`tool`][] (with a PII vault the
            tool gets the user's values, except under ``masked_arguments`` or with
            ``sees_values=False``).
        approval / waiting_message: as for [`tool`][].

    Raises:
        ToolDefinitionError: an invalid name, an empty description, a schema that is not a
            valid JSON schema of an object, or a masked argument the schema does not name.
    """
    if not _NAME.match(name):
        raise ToolDefinitionError(
            f"tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-'"
        )
    if not description.strip():
        raise ToolDefinitionError(f"tool {name!r} has no description")
    if timeout_s is not None and timeout_s <= 0:
        raise ToolDefinitionError(f"tool {name!r}: timeout_s must be positive")
    if max_output_chars is not None and max_output_chars < 1:
        raise ToolDefinitionError(f"tool {name!r}: max_output_chars must be at least 1")
    schema = _object_schema(name, parameters)
    validator_class = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    names = tuple(schema.get("properties", {}))
    unknown = sorted(set(masked_arguments) - set(names))
    if unknown:
        raise ToolDefinitionError(
            f"tool {name!r}: masked_arguments names arguments it does not take: {unknown}"
        )
    checked_approval = check_approval(name, approval)
    args_model = type(
        f"{name}_arguments",
        (_SchemaArguments,),
        {"validator": validator_class(schema), "names": names, "__module__": __name__},
    )
    built = SchemaTool(
        name=name,
        description=description.strip(),
        function=function,
        args_model=args_model,
        # A call a person must approve is consequential: journalled, so it runs once.
        side_effect=side_effect or approval not in (None, False),
        idempotent=(not side_effect) if idempotent is None else idempotent,
        timeout_s=timeout_s,
        max_output_chars=max_output_chars,
        context_parameter="context",
        sees_values=sees_values,
        masked_arguments=tuple(masked_arguments),
        approval=checked_approval,
        waiting_message=check_waiting_message(name, checked_approval, waiting_message),
    )
    built.__dict__["_parameters"] = schema  # seeds the cached_property: the schema as given
    return built


def _object_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` checked: a valid JSON schema describing an object."""
    if not isinstance(parameters, Mapping):
        raise ToolDefinitionError(f"tool {name!r}: its schema is not a JSON object")
    schema = copy.deepcopy(dict(parameters))
    schema.setdefault("type", "object")
    if schema["type"] != "object":
        raise ToolDefinitionError(
            f"tool {name!r}: its arguments must be an object, not {schema['type']!r}"
        )
    if not isinstance(schema.get("properties", {}), Mapping):
        raise ToolDefinitionError(f"tool {name!r}: 'properties' must be an object")
    try:
        validator_class = jsonschema.validators.validator_for(
            schema, jsonschema.Draft202012Validator
        )
        validator_class.check_schema(schema)
    except SchemaError as exc:
        raise ToolDefinitionError(
            f"tool {name!r}: its argument schema is invalid: {exc.message}"
        ) from exc
    return schema
