"""A run as a readable rich tree: each step with its kind, timings, tokens and errors.

Used by ``keel runs show`` and available to any console front end (``keel chat``'s ``/trace``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keel.tracing._models import Run, RunDetail, Step, StepNode

if TYPE_CHECKING:
    from rich.tree import Tree

__all__ = ["STATUS_STYLE", "format_ms", "render_run"]

STATUS_STYLE = {
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "limited": "yellow",
    "escalated": "magenta",
    "interrupted": "yellow",
    "abandoned": "red",
}
"""The rich style of each run status."""

_KIND_STYLE = {"model": "cyan", "tool": "magenta", "guard": "yellow", "reset": "red"}


def format_ms(value: float | None) -> str:
    """A duration in milliseconds for people: ``-``, ``0.4 ms``, ``85 ms``, ``12.3 s``."""
    if value is None:
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.1f} s"
    if value < 10:
        return f"{value:.1f} ms"
    return f"{value:.0f} ms"


def _when(run: Run) -> str:
    return run.started_at.strftime("%Y-%m-%d %H:%M:%S")


def _clip(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _label(step: Step, width: int) -> str:
    from rich.markup import escape

    parts = [f"[{_KIND_STYLE.get(step.kind, 'blue')}]{step.kind}[/] [bold]{escape(step.name)}[/]"]
    parts.append(format_ms(step.latency_ms))
    if step.ttft_ms is not None:
        parts.append(f"ttft {format_ms(step.ttft_ms)}")
    if step.prompt_tokens or step.completion_tokens:
        parts.append(f"{step.prompt_tokens}→{step.completion_tokens} tok")
    if step.attempt > 1:
        parts.append(f"[yellow]attempt {step.attempt}[/]")
    if step.state_version is not None:
        parts.append(f"state v{step.state_version}")
    if step.finish_reason:
        parts.append(f"finish {escape(step.finish_reason)}")
    line = " · ".join(parts)
    if step.error_type:
        message = escape(_clip(step.error_message or "", width))
        line += f"\n[red]✗ {escape(step.error_type)}[/]: {message}"
    if step.tool_arguments is not None:
        line += f"\n[dim]args[/] {escape(_clip(step.tool_arguments, width))}"
    if step.tool_result is not None:
        size = len(step.tool_result)
        line += f"\n[dim]result ({size} chars)[/] {escape(_clip(step.tool_result, width))}"
    if step.raw_output:
        line += f"\n[dim]output[/] {escape(_clip(step.raw_output, width))}"
    return line


def _add(tree: Tree, nodes: list[StepNode], width: int) -> None:
    for node in nodes:
        branch = tree.add(_label(node.step, width))
        _add(branch, node.children, width)


def render_run(detail: RunDetail, *, width: int = 120) -> Tree:
    """The run as a rich Tree: a header with its totals, then its steps nested as they ran.

    Long texts (outputs, arguments, results, errors) are cut to ``width`` characters.
    """
    from rich.markup import escape
    from rich.tree import Tree

    run = detail.run
    style = STATUS_STYLE.get(run.status, "")
    header = (
        f"[bold]run {run.run_id}[/] · [{style}]{run.status}[/] · session {escape(run.session_id)}"
        f" · agent {escape(run.agent)}"
    )
    if run.user_id:
        header += f" · user {escape(run.user_id)}"
    header += (
        f"\n{_when(run)} UTC · {format_ms(run.duration_ms)} · {run.step_count} steps · "
        f"{run.prompt_tokens}→{run.completion_tokens} tok · {run.model_calls} model calls · "
        f"{run.tool_calls} tool calls ({run.tool_errors} failed)"
    )
    if run.input:
        header += f"\n[dim]input[/] {escape(_clip(run.input, width))}"
    if run.output:
        header += f"\n[dim]output[/] {escape(_clip(run.output, width))}"
    if run.error_type:
        header += f"\n[red]✗ {escape(run.error_type)}[/]: {escape(run.error_message or '')}"
    tree = Tree(header)
    _add(tree, detail.tree(), width)
    return tree
