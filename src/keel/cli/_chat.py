"""``keel chat``: an interactive agent whose memory and state persist (``Agent.open``); its
replies stream as they are generated (``Agent.stream``)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from keel.cli._app import app, out_console

if TYPE_CHECKING:
    from keel.runtime import Agent

_HELP = (
    "Commands: /state (the session's state), /memory QUERY (what memory retrieves), "
    "/trace (the last turn's steps), /quit. Ctrl-C stops a turn safely."
)
_SYSTEM = (
    "You are a helpful, concise assistant. Use what you remember about the user when it is "
    "relevant; say so when you do not know."
)


def _build(model_spec: str | None, memory: bool, database: str | None) -> Agent:
    from keel.runtime import Agent

    # Agent.open: the database URL (default KEEL_DATABASE, else the embedded SQLite file) holds
    # the journal, traces and memory, and state unless KEEL_REDIS_URL moves it to Redis.
    return Agent.open(database, model=model_spec, system_prompt=_SYSTEM, memory=memory, name="chat")


@app.command("chat")
def chat_command(
    session: Annotated[str, typer.Option(help="Session id; reuse it to continue.")] = "chat",
    user: Annotated[str, typer.Option(help="User id (memory is scoped to it).")] = "local-user",
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model spec (default: settings.model).")
    ] = None,
    memory: Annotated[bool, typer.Option(help="Use long-term memory.")] = True,
    database: Annotated[
        str | None,
        typer.Option(
            "--database",
            help="Database URL: sqlite:///PATH or postgresql://... (default: KEEL_DATABASE, "
            "else keel.db in the data directory). KEEL_REDIS_URL keeps state on Redis.",
        ),
    ] = None,
) -> None:
    """Chat with an agent whose memory and state survive restarts (same --session)."""
    from keel.tracing import RunQuery

    agent = _build(model, memory, database)
    assert agent.backends is not None  # Agent.open keeps what it opened
    long_term, traces = agent.memory, agent.backends.traces
    interactive = sys.stdin.isatty()
    out_console.print(f"keel chat · session {session} · {agent.model.spec}. {_HELP}")
    last_run: str | None = None

    def show(text: str) -> None:
        out_console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    async def turn(text: str) -> None:
        """One turn, streamed: the reply's text as it arrives, tool calls as they start."""
        nonlocal last_run
        out_console.print("[bold]agent>[/] ", end="")
        streamed = ""
        async for event in agent.stream(text, session=session, user=user):
            if event.type == "text":
                show(event.text)
                streamed += event.text
            elif event.type == "text_discarded":
                out_console.print("\n[dim](that reply was unusable; asking again)[/]")
                out_console.print("[bold]agent>[/] ", end="")
                streamed = ""
            elif event.type == "tool_call_started":
                arguments = json.dumps(event.arguments, ensure_ascii=False)
                out_console.print(f"\n[dim]→ {event.name}[/] ", end="")
                show(arguments + "\n")
                out_console.print("[bold]agent>[/] ", end="")
                streamed = ""
            elif event.type == "final":
                last_run = event.reply.run_id
                # The reply is authoritative (a failed turn ends with a clean message).
                if event.reply.text != streamed:
                    if streamed:
                        out_console.print()
                        out_console.print("[bold]agent>[/] ", end="")
                    show(event.reply.text)
                out_console.print()

    # One event loop for the whole chat: model clients keep connections bound to it.
    runner = asyncio.Runner()
    try:
        resumed = runner.run(agent.resume(session, user))
        if resumed is not None:
            out_console.print(f"[dim](finished an interrupted turn)[/] {resumed.text}")
        while True:
            try:
                line = input("you> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not interactive and not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/state":
                state = agent.session_state(session)
                payload = None if state is None else state.model_dump(mode="json")
                if payload is not None:
                    payload["messages"] = payload["messages"][-6:]
                out_console.print_json(json.dumps(payload, default=str))
                continue
            if text.startswith("/memory"):
                query = text.removeprefix("/memory").strip() or "what do I know about the user"
                if long_term is None:
                    out_console.print("memory is off (--no-memory)")
                    continue
                from keel.memory import Scope

                long_term.flush()
                packed = long_term.retrieve(
                    query, scope=Scope(tenant_id=agent.tenant_id, user_id=user), budget_tokens=400
                )
                out_console.print(packed.text or "(nothing relevant remembered)", markup=False)
                continue
            if text == "/trace":
                runs = traces.list_runs(RunQuery(session_id=session, limit=1))
                if not runs:
                    out_console.print("(no runs yet)")
                    continue
                detail = traces.get_run_detail(runs[0].run_id)
                for step in detail.steps if detail is not None else ():
                    out_console.print(
                        f"  {step.kind:<10} {step.name:<28} tokens {step.prompt_tokens}"
                        f"+{step.completion_tokens}  {step.latency_ms or 0:.0f} ms",
                        markup=False,
                    )
                continue
            try:
                runner.run(turn(text))
            except KeyboardInterrupt:
                # The checkpoint before the model call is committed; the open turn is finished
                # by resume() on the next start. Nothing half-written is visible.
                out_console.print("\n[dim](turn interrupted; it will resume next time)[/]")
                continue
    except KeyboardInterrupt:
        out_console.print("\nbye")
    finally:
        # On the chat's loop: async clients (PostgreSQL, Redis) belong to it.
        try:
            runner.run(agent.aclose())
        finally:
            runner.close()
