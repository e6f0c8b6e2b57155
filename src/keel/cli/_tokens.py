"""``keel tokens``: exact token counts from the command line."""

from __future__ import annotations

from typing import Annotated

import typer

from keel.cli._app import JsonOption, app, emit_json, out_console


@app.command("tokens")
def tokens_command(
    text: Annotated[str, typer.Argument(help="The text to count; '-' reads standard input.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Model name or spec.")] = "gpt-4o",
    as_json: JsonOption = False,
    estimate: Annotated[
        bool,
        typer.Option("--estimate", help="For an unknown model, print a padded estimate."),
    ] = False,
) -> None:
    """Print the exact number of tokens TEXT costs for MODEL (no network)."""
    import sys

    from keel.tokens import count_tokens

    if text == "-":
        text = sys.stdin.read()
    result = count_tokens(text, model, allow_estimate=estimate)
    if as_json:
        emit_json(result.model_dump())
        return
    suffix = "" if result.exact else " (estimate)"
    out_console.print(f"{result.tokens} tokens ({result.encoding}){suffix}")
