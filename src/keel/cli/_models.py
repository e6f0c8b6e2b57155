"""``keel complete`` and ``keel bench models``: talk to a model, measure the model layer."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonOption, app, bench_app, emit_json, emit_or_show, out_console


@app.command("complete")
def complete_command(
    prompt: Annotated[str, typer.Argument(help="The user message; '-' reads standard input.")],
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Model spec (default: the 'model' setting)."),
    ] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system prompt.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens.")] = 256,
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, max=2.0, help="Sampling.")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", min=0.001, help="Seconds for the whole call.")
    ] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it arrives.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Ask MODEL for one answer to PROMPT and print it with its usage."""
    import sys

    from keel.messages import Message
    from keel.models import Completion, ModelOptions, resolve_model

    if prompt == "-":
        prompt = sys.stdin.read()
    chat = resolve_model(model)
    messages = [Message.system(system)] if system else []
    messages.append(Message.user(prompt))
    # A command-line answer cut at --max-tokens is still worth showing; it is flagged.
    options = ModelOptions(
        max_tokens=max_tokens, temperature=temperature, timeout_s=timeout, allow_truncated=True
    )
    completion: Completion | None = None
    if stream and not as_json:
        for chunk in chat.stream(messages, options=options):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            completion = chunk.completion or completion
        sys.stdout.write("\n")
    else:
        completion = chat.complete(messages, options=options)
    assert completion is not None
    if as_json:
        emit_json(completion_summary(completion))
        return
    if not stream:
        out_console.print(completion.text, markup=False)
    for call in completion.message.tool_calls:
        out_console.print(f"tool call: {call.name}({call.arguments})", markup=False)
    usage = completion.usage
    ttft = f", ttft {completion.ttft_ms:.0f} ms" if completion.ttft_ms is not None else ""
    out_console.print(
        f"[dim]{completion.model}: {usage.prompt_tokens} prompt + {usage.completion_tokens} "
        f"completion tokens, {completion.latency_ms:.0f} ms{ttft}, "
        f"finish={completion.finish_reason}[/]",
        markup=True,
    )


def completion_summary(completion: Any) -> dict[str, Any]:
    """The JSON form of a completion that ``keel complete --json`` prints."""
    return {
        "model": completion.model,
        "text": completion.text,
        "tool_calls": [call.model_dump() for call in completion.message.tool_calls],
        "finish_reason": completion.finish_reason,
        "truncated": completion.truncated,
        "usage": {
            "prompt_tokens": completion.usage.prompt_tokens,
            "completion_tokens": completion.usage.completion_tokens,
            "total_tokens": completion.usage.total_tokens,
        },
        "latency_ms": round(completion.latency_ms, 1),
        "ttft_ms": None if completion.ttft_ms is None else round(completion.ttft_ms, 1),
        "attempts": completion.attempts,
    }


@bench_app.command("models")
def bench_models_command(
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=8, help="Tokens to generate for the speed run.")
    ] = 64,
    skip_local: Annotated[
        bool, typer.Option("--skip-local", help="Only run the fault scenarios.")
    ] = False,
    tool_prompts: Annotated[
        int,
        typer.Option(
            "--tool-prompts",
            min=0,
            help="Tool-requiring prompts for the tool-call rates (0: skip).",
        ),
    ] = 100,
    as_json: JsonOption = False,
) -> None:
    """Measure the local model (load, time to first token, tokens/s, valid tool calls with and
    without its grammar) and every fault kind."""
    from keel.bench.models import run_model_bench

    report = run_model_bench(
        max_tokens=max_tokens, local=not skip_local, tool_prompts_count=tool_prompts
    )
    emit_or_show(report, as_json, _show_bench)


def _show_bench(report: dict[str, Any]) -> None:
    local = report.get("local")
    if local:
        out_console.print(
            f"local:smollm2  load {local['load_s']:.2f} s  ttft {local['ttft_ms']:.0f} ms  "
            f"{local['tokens_per_s']:.1f} tokens/s ({local['completion_tokens']} tokens)"
        )
    rates = report.get("tool_call_valid_rate")
    if rates:
        out_console.print(
            f"valid tool calls (tool_choice=required, {report['tool_calls']['prompts']} prompts): "
            f"constrained {rates['constrained']:.0%}, unconstrained {rates['unconstrained']:.0%}"
        )
    faults = report["faults"]
    for name, row in faults["kinds"].items():
        mark = "ok  " if row["handled"] else "FAIL"
        out_console.print(
            f"{mark} {name:<28} expected {row['expected']:<28} got {row['got']:<28} "
            f"attempts {row['attempts']}  {row['elapsed_s']:.2f} s"
        )
    out_console.print(f"faults: {faults['total']} kinds, {faults['unhandled']} unhandled")
    if faults["unhandled"]:
        raise typer.Exit(1)
