"""``keel bench context``: the context engine over a long synthetic conversation."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonLastOption, bench_app, emit_or_show, out_console


@bench_app.command("context")
def bench_context_command(
    turns: Annotated[int, typer.Option("--turns", min=1, help="Conversation turns.")] = 1000,
    model: Annotated[str, typer.Option("--model", "-m", help="Model to count for.")] = "gpt-4o",
    budget: Annotated[
        int, typer.Option("--budget", min=1024, help="Working budget in tokens.")
    ] = 16_000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic conversation.")] = 7,
    as_json: JsonLastOption = False,
) -> None:
    """Compile every model call of a long conversation; compare full context and trim_messages."""
    from keel.bench.context import run_context_benchmark

    result = run_context_benchmark(turns, model=model, working_budget=budget, seed=seed)
    emit_or_show(result, as_json, _show)


def _show(result: dict[str, Any]) -> None:
    turns = result["turns"]
    lc = result["baselines"]["langchain_trim_messages"]
    out_console.print(
        f"{result['turns']} turns, {result['compiles']} prompts for {result['model']} "
        f"(budget {result['budget']}, limit {result['prompt_limit']})\n"
        f"violations: {result['violations']}   max prompt: {result['max_prompt_tokens']} tokens\n"
        f"prompt at turn 100: {result['prompt_tokens_turn100']}, at the last turn: "
        f"{result[f'prompt_tokens_turn{turns}']}\n"
        f"assembly p50 {result['assembly_ms_p50']} ms, p99 {result['assembly_ms_p99']} ms; "
        f"summarizer {result['summarizer']['ms_total']} ms in {result['summarizer']['runs']} runs\n"
        f"reduction vs full context: {result['token_reduction_vs_full']:.1%}\n"
        f"trim_messages: p50 {lc['assembly_ms_p50']} ms, p99 {lc['assembly_ms_p99']} ms, "
        f"orphans in {lc['prompts_with_orphans']} prompts, newest user message lost in "
        f"{lc['prompts_missing_newest_user_message']}"
    )
