"""The Typer application every ``keel`` command registers on.

Commands import their heavy dependencies inside the function body so ``keel --help`` and
``keel tokens`` start fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from keel.errors import KeelError, UsageError

__all__ = [
    "JsonLastOption",
    "JsonOption",
    "app",
    "bench_app",
    "demo_model_note",
    "emit_json",
    "emit_or_show",
    "err_console",
    "fail",
    "out_console",
]

app = typer.Typer(
    name="keel",
    help="keel: a runtime that keeps LLM agents from crashing, drifting or forgetting.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks that print their figures (last line: one JSON object with --json).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


def _print_version(asked: bool) -> None:
    if asked:
        from keel._version import __version__

        out_console.print(f"keel {__version__}", markup=False)
        raise typer.Exit()


@app.callback()
def _keel(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print keel's version (the keel-runtime package's) and exit.",
        ),
    ] = False,
) -> None:
    """keel: a runtime that keeps LLM agents from crashing, drifting or forgetting."""


JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
"""``--json``: the command's output is one JSON object instead of text."""
JsonLastOption = Annotated[bool, typer.Option("--json", help="Last line: one JSON object.")]
"""``--json`` on a command that reports progress first: its last line is one JSON object."""

out_console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(payload: Any) -> None:
    """Print one JSON object on one line (the machine-readable contract of ``--json``)."""
    sys.stdout.write(json.dumps(payload, default=str, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def emit_or_show(
    payload: dict[str, Any], as_json: bool, show: Callable[[dict[str, Any]], None]
) -> None:
    """What a command with ``--json`` prints: the payload as one JSON line, else what ``show``
    makes of it for people."""
    if as_json:
        emit_json(payload)
    else:
        show(payload)


def fail(error: KeelError | str, *, code: int | None = None) -> NoReturn:
    """Print one clear error line (no traceback) and exit: 2 for usage errors, else 1."""
    text = str(error)
    err_console.print(f"[bold red]error:[/] {escape(text)}", markup=True, highlight=False)
    if code is None:
        code = 2 if isinstance(error, UsageError) else 1
    raise typer.Exit(code)


BUNDLED_MODEL = "local:smollm2"
"""The default model: small enough to ship with keel, too small to hold a conversation."""


def demo_model_note(spec: str) -> str | None:
    """What a user of the bundled model must know (None for any other model): it is a
    135M-parameter demo model, and how to point keel at a real one."""
    if spec != BUNDLED_MODEL:
        return None
    return (
        f"{BUNDLED_MODEL} is the bundled SmolLM2-135M-Instruct, a 135M-parameter demo model: "
        "it runs offline but gives poor, repetitive answers. For a real model set KEEL_MODEL, "
        "e.g. KEEL_MODEL=openai:gpt-4o-mini (with OPENAI_API_KEY) or "
        "KEEL_MODEL=openai-compatible:MODEL@http://localhost:11434/v1 (Ollama, vLLM, ...)."
    )
