"""Usage errors as a user meets them: one error line and exit code 2, never a traceback, for
every command, with the Typer the venv installs (whose bundled click copy raises its own
exception classes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click
import pytest
import typer

from keel.cli import app, main
from tests.cli import keel_process


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("runs", "lst"), "No such command 'lst'"),
        (("runs", "show"), "Missing argument"),
        (("demo", "--bogus"), "No such option: --bogus"),
        (("demo", "--trips", "abc"), "'--trips'"),
        (("demo", "--trips", "0"), "'--trips'"),
        (("runs", "list", "--database", "foo://bar"), "foo://"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(args: tuple[str, ...], says: str) -> None:
    result = keel_process(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert says in _one_error_line(result.stderr)


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command under ``group`` (a click command of Typer's click)."""
    commands = getattr(group, "commands", None)
    if commands is None:
        yield path
        return
    for name, command in commands.items():
        yield from _commands(command, (*path, name))


def test_typer_raises_exceptions_click_does_not_catch() -> None:
    """Why the CLI cannot rely on ``except click.ClickException`` (if this fails, the installed
    Typer uses click itself again and the test below still covers every command)."""
    assert not issubclass(typer.BadParameter, click.ClickException)


def test_every_command_answers_an_unknown_option_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = list(_commands(typer.main.get_command(app)))
    assert len(paths) > 20 and ("runs", "stats") in paths and ("bench", "demo") not in paths
    for path in paths:
        assert main([*path, "--no-such-option"]) == 2, path
        captured = capsys.readouterr()
        line = _one_error_line(captured.err)
        assert "--no-such-option" in line and f"keel {' '.join(path)} --help" in line, path
