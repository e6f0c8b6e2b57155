"""keel's command line. ``main`` is the console entry point."""

from __future__ import annotations

import sys
from types import ModuleType

import typer
from rich.markup import escape

# Importing the command modules registers their commands on the app.
from keel.cli import (  # noqa: F401
    _approvals,
    _bench_cluster,
    _bench_masking,
    _bench_privacy,
    _chat,
    _context,
    _demo,
    _doctor,
    _integrations,
    _mcp,
    _memory,
    _models,
    _models_install,
    _privacy,
    _runs,
    _serve,
    _state,
    _stream,
    _tau2,
    _tokens,
    _tools,
    _turns,
    _ui,
)
from keel.cli._app import app, err_console
from keel.errors import KeelError, UsageError

__all__ = ["app", "main"]


def _click() -> ModuleType:
    """The click exceptions module Typer raises from: click's own, or the copy that newer Typer
    versions bundle (``typer._click``), whose classes an ``except click.ClickException`` misses.
    Found from the class Typer exports, so it follows whichever Typer is installed."""
    return sys.modules[typer.BadParameter.__module__]


def _usage_line(exc: Exception) -> str:
    """A click usage error as one line: the problem, and where the command's help is."""
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    context = getattr(exc, "ctx", None)
    if context is None:
        return message
    return f"{message} (see: {context.command_path} --help)"


def _log_to_data_dir() -> None:
    """keel's runtime warnings (guards, tracing) go to ``<data dir>/keel.log``, not the terminal.

    A CLI's output is what the user asked for; operational warnings are kept for later.
    """
    import logging

    from keel.settings import load_settings

    logger = logging.getLogger("keel")
    if any(not isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        return
    handler: logging.Handler
    try:
        settings = load_settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(settings.data_dir / "keel.log", encoding="utf-8")
    except (KeelError, OSError):
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _show_click_error(exc: Exception) -> int:
    """A click error as one line on stderr (a group run without its command: its help)."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()  # type: ignore[attr-defined]
    else:
        line = _usage_line(exc) if isinstance(exc, _click().UsageError) else str(exc)
        err_console.print(f"[bold red]error:[/] {escape(line)}", markup=True, highlight=False)
    return int(exc.exit_code)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a KeelError becomes one error line and a non-zero exit code."""
    _log_to_data_dir()
    try:
        # Without standalone mode click returns the exit code of typer.Exit instead of exiting.
        result = app(args=argv, prog_name="keel", standalone_mode=False)
    except KeelError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
        return 2 if isinstance(exc, UsageError) else 1
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except typer.Abort:
        err_console.print("aborted")
        return 130
    except _click().ClickException as exc:
        return _show_click_error(exc)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
