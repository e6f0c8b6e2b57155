"""``@tool(sees_values=..., masked_arguments=...)``: what a tool declares of the user's PII
values is kept on the tool, and a masked argument it does not take is a definition error."""

from __future__ import annotations

import pytest

from keel.errors import ToolDefinitionError
from keel.tools import tool


def test_the_privacy_options_are_kept_on_the_tool() -> None:
    @tool(masked_arguments=("token",))
    def forward(email: str, token: str) -> str:
        """Forward a request.

        Args:
            email: The customer.
            token: Passed on unread.
        """
        return "ok"

    @tool(sees_values=False)
    def audit(email: str) -> str:
        """Audit a request.

        Args:
            email: The customer.
        """
        return "ok"

    assert (forward.sees_values, forward.masked_arguments) == (True, ("token",))
    assert (audit.sees_values, audit.masked_arguments) == (False, ())


def test_a_masked_argument_the_tool_does_not_take_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match=r"masked_arguments.*\['tokn'\]"):

        @tool(masked_arguments=("tokn",))
        def forward(email: str, token: str) -> str:
            """Forward a request.

            Args:
                email: The customer.
                token: Passed on unread.
            """
            return "ok"
