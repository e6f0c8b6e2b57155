"""Corrected arguments checked where no tool is at hand: against the arguments schema a request
carries (the command line, and a viewer whose agent lacks the request's tool)."""

from __future__ import annotations

from typing import Any

from keel.approvals._model import ApprovalRequest
from keel.errors import ToolArgumentsError, UsageError

__all__ = ["check_corrected_arguments"]


def check_corrected_arguments(request: ApprovalRequest, arguments: dict[str, Any]) -> None:
    """Refuse corrected arguments the request's tool would refuse: checked here, against the
    schema the request carries, so that a correction the tool cannot take is never recorded
    as approved.

    Raises:
        UsageError: the request names no tool, or no schema (made before keel recorded one):
            there is nothing to check the correction against.
        ToolArgumentsError: one line per problem.
    """
    import jsonschema  # imported when a correction is checked: most decisions have none

    if request.tool is None:
        raise UsageError(f"{request.id} is an escalated turn: --arguments corrects a tool call")
    schema = request.arguments_schema
    if schema is None:
        raise UsageError(
            f"{request.id} was made before keel recorded its tool's arguments schema, so "
            "corrected arguments cannot be checked here: nothing was decided. Approve or "
            "reject it without --arguments, or correct it through the application "
            "(agent.decide, POST /v1/approvals/ID), which checks them against the tool."
        )
    validator_class = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    problems = [
        f"{'.'.join(str(part) for part in error.absolute_path) or 'arguments'}: {error.message}"
        for error in validator_class(schema).iter_errors(arguments)
    ]
    if problems:
        raise ToolArgumentsError(request.tool, sorted(problems))
