"""``keel chat``: an interactive agent on the embedded default whose memory and state persist."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any

import typer

from keel.cli._app import app, out_console

_HELP = (
    "Commands: /state (the session's state), /memory QUERY (what memory retrieves), "
    "/trace (the last turn's steps), /quit. Ctrl-C stops a turn safely."
)
_SYSTEM = (
    "You are a helpful, concise assistant. Use what you remember about the user when it is "
    "relevant; say so when you do not know."
)


def _build(model_spec: str | None, memory: bool) -> tuple[Any, Any, Any]:
    from keel.models import resolve_model
    from keel.runtime import Agent
    from keel.settings import load_settings
    from keel.state import AgentState, StateStore
    from keel.stores import SQLiteStateBackend, SQLiteToolJournal, open_database
    from keel.stores._sqlite_traces import SQLiteTraceStore
    from keel.tracing import Tracer

    settings = load_settings()
    database = open_database(settings)
    traces = SQLiteTraceStore(database)
    traces.setup()
    long_term = None
    if memory:
        from keel.memory import Memory, embedder_from_settings
        from keel.stores import SQLiteMemoryStore

        long_term = Memory(
            SQLiteMemoryStore(database), embedder=embedder_from_settings(settings), background=True
        )
    agent = Agent(
        resolve_model(model_spec or settings.model, settings=settings),
        state=StateStore(SQLiteStateBackend(database), AgentState),
        system_prompt=_SYSTEM,
        memory=long_term,
        journal=SQLiteToolJournal(database),
        tracer=Tracer(traces, agent="chat"),
        name="chat",
    )
    return agent, long_term, traces


@app.command("chat")
def chat_command(
    session: Annotated[str, typer.Option(help="Session id; reuse it to continue.")] = "chat",
    user: Annotated[str, typer.Option(help="User id (memory is scoped to it).")] = "local-user",
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model spec (default: settings.model).")
    ] = None,
    memory: Annotated[bool, typer.Option(help="Use long-term memory.")] = True,
) -> None:
    """Chat with an agent whose memory and state survive restarts (same --session)."""
    from keel.tracing import RunQuery

    agent, long_term, traces = _build(model, memory)
    interactive = sys.stdin.isatty()
    out_console.print(f"keel chat · session {session} · {agent.model.spec}. {_HELP}")
    last_run: str | None = None

    async def turn(text: str) -> str:
        reply = await agent.handle(session, user, text)
        nonlocal last_run
        last_run = reply.run_id
        return str(reply.text)

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
                answer = runner.run(turn(text))
            except KeyboardInterrupt:
                # The checkpoint before the model call is committed; the open turn is finished
                # by resume() on the next start. Nothing half-written is visible.
                out_console.print("\n[dim](turn interrupted; it will resume next time)[/]")
                continue
            out_console.print(f"[bold]agent>[/] {answer}", highlight=False)
    except KeyboardInterrupt:
        out_console.print("\nbye")
    finally:
        runner.close()
        if long_term is not None:
            long_term.close()
        traces.close()
