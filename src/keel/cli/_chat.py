"""``keel chat``: an interactive agent whose memory and state persist (``Agent.open``); its
replies stream as they are generated (``Agent.stream``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from keel.cli._app import app, demo_model_note, out_console
from keel.cli._database import CreateOption
from keel.errors import KeelError

if TYPE_CHECKING:
    from rich.console import Console

    from keel.runtime import Agent, AgentReply

_HELP = (
    "Commands: /help, /state (the session's state; /state all for every message), /memory QUERY "
    "(what memory retrieves), /trace (the last turn's steps), /approve ID [NOTE] and /reject ID "
    "[NOTE] (decide a call that waits for approval), /quit. Ctrl-C cancels the answer."
)
_DECIDER = "operator:chat"
"""Who decides what the person at the terminal approves or rejects (as the record shows it)."""
_SYSTEM = (
    "You are a helpful, concise assistant. Use what you remember about the user when it is "
    "relevant; say so when you do not know."
)
STATE_MESSAGES_SHOWN = 6
"""Messages /state shows (the newest); /state all shows every one."""


def _build(
    model_spec: str | None, memory: bool, database: str | None, *, create: bool = False
) -> Agent:
    # Lazy: every keel command imports this module to register ``chat``; the runtime (numpy,
    # the stores, the model clients) loads only when a chat starts.
    from keel.cli._database import database_settings
    from keel.runtime import Agent

    # The database (default KEEL_DATABASE, else the embedded SQLite file) holds the journal,
    # traces and memory, and state unless KEEL_REDIS_URL moves it to Redis. A --database file
    # that is not there is a typo unless --create says to start one.
    settings = database_settings(database, writes=True, create=create)
    return Agent.open(settings, model=model_spec, system_prompt=_SYSTEM, memory=memory, name="chat")


class Chat:
    """One chat on one session: reads lines, streams the agent's replies, runs the commands.

    Ctrl-C in a reply cancels the turn as a person means it: the answer stops there and is not
    finished later, and the session's history says the user cancelled it (``on_cancel=
    "close"``), so the next message is answered on its own. A turn a crash (or a second Ctrl-C
    while the cancellation was written) left open is finished first, saying so.
    """

    def __init__(self, agent: Agent, session: str, user: str, console: Console) -> None:
        self.agent = agent
        self.session = session
        self.user = user
        self.console = console
        self.last_run: str | None = None
        self.interrupted = False
        # One event loop for the whole chat, in this (the main) thread: Ctrl-C cancels the turn
        # on it directly (asyncio.Runner's SIGINT handler). On the bridge loop, the interrupt
        # had to reach the main thread first, and in three full test runs in a row it did not.
        self._runner = asyncio.Runner()

    def run(self, read_line: Callable[[], str | None]) -> None:
        """Chat until ``read_line`` returns None (end of input), /quit, or Ctrl-C at the prompt;
        the agent is closed at the end.

        Turns run on the chat's own loop; Ctrl-C cancels the turn there and returns once the
        turn has unwound."""
        try:
            self._greet()
            self._finish_open_turn()
            while (line := read_line()) is not None:
                text = line.strip()
                if text in ("/quit", "/exit"):
                    break
                if text.startswith("/"):
                    self._command(text)
                elif text:
                    self._say(text)
        except KeyboardInterrupt:
            self.console.print("\nbye")
        finally:
            # On the chat's loop: async clients (PostgreSQL, Redis) belong to it.
            try:
                self._runner.run(self.agent.aclose())
            finally:
                self._runner.close()

    def _greet(self) -> None:
        spec = self.agent.model.spec
        self.console.print(f"keel chat · session {self.session} · {spec}. {_HELP}")
        note = demo_model_note(spec)
        if note is not None:
            self.console.print(f"[yellow]note:[/] {note}", highlight=False)
        state = self.agent.session_state(self.session)
        if state is not None and state.messages:
            count = len(state.messages)
            self.console.print(
                f"[dim](resuming session {self.session}: {count} "
                f"message{'' if count == 1 else 's'} so far; /state all shows them)[/]",
                highlight=False,
            )

    def _say(self, text: str) -> None:
        if self.interrupted and not self._finish_open_turn():
            return
        try:
            self._runner.run(self._turn(text))
        except KeyboardInterrupt:
            self._cancelled()

    def _cancelled(self) -> None:
        """Ctrl-C stopped a turn: closed as cancelled (what the turn wrote on its way out), or,
        when that write could not happen, left open for the next message to finish first."""
        state = self.agent.session_state(self.session)
        if state is None or state.runtime.open_turn is None:
            self.console.print("\n[dim](cancelled: that answer stops here, as the history says)[/]")
            return
        self.interrupted = True
        self.console.print("\n[dim](turn interrupted; your next message finishes it first)[/]")

    def _finish_open_turn(self) -> bool:
        """Finish the turn an interruption left open, saying so and showing its reply; False
        when Ctrl-C stopped that too."""
        state = self.agent.session_state(self.session)
        if state is None or state.runtime.open_turn is None:
            self.interrupted = False
            return True
        self.console.print("[dim](finishing the interrupted turn first...)[/]")
        try:
            reply = self._runner.run(self.agent.resume(self.session, self.user))
        except KeyboardInterrupt:
            self.console.print(
                "\n[dim](interrupted again: that turn stays open, and your new message was "
                "not sent)[/]"
            )
            return False
        self.interrupted = False
        if reply is not None:
            self._show_finished(reply)
        return True

    def _show_finished(self, reply: AgentReply) -> None:
        self.last_run = reply.run_id
        outcome = "completed" if reply.status == "completed" else f"ended: {reply.status}"
        self.console.print(f"[dim](the interrupted turn {outcome})[/]")
        self.console.print("[bold]agent>[/] ", end="")
        self._show(reply.text + "\n")

    def _show(self, text: str) -> None:
        self.console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    async def _turn(self, text: str) -> None:
        """One turn, streamed: the reply's text as it arrives, tool calls as they start."""
        console, show = self.console, self._show
        console.print("[bold]agent>[/] ", end="")
        streamed = ""
        turn = self.agent.stream(text, session=self.session, user=self.user, on_cancel="close")
        async for event in turn:
            if event.type == "text":
                show(event.text)
                streamed += event.text
            elif event.type == "text_discarded":
                console.print("\n[dim](that reply was unusable; asking again)[/]")
                console.print("[bold]agent>[/] ", end="")
                streamed = ""
            elif event.type == "tool_call_started":
                arguments = json.dumps(event.arguments, ensure_ascii=False)
                console.print(f"\n[dim]→ {event.name}[/] ", end="")
                show(arguments + "\n")
                console.print("[bold]agent>[/] ", end="")
                streamed = ""
            elif event.type == "final":
                self.last_run = event.reply.run_id
                # The reply is authoritative (a failed turn ends with a clean message).
                if event.reply.text != streamed:
                    if streamed:
                        console.print()
                        console.print("[bold]agent>[/] ", end="")
                    show(event.reply.text)
                console.print()
                self._show_waiting(event.reply)

    def _show_waiting(self, reply: AgentReply) -> None:
        """The calls the turn waits on, with the commands that decide them here."""
        for pending in reply.approvals:
            if pending.status == "pending":
                self.console.print(
                    f"[dim](waiting: {pending.tool} needs approval; /approve {pending.id} "
                    f"[NOTE] or /reject {pending.id} [NOTE])[/]",
                    highlight=False,
                )

    def _command(self, text: str) -> None:
        name, _, argument = text.partition(" ")
        if name == "/state":
            self._state(every=argument.strip() == "all")
        elif name == "/memory":
            self._memory(argument.strip() or "what do I know about the user")
        elif name == "/trace":
            self._trace()
        elif name in ("/approve", "/reject"):
            self._decide(name == "/approve", argument.strip())
        elif name == "/help":
            self.console.print(_HELP, markup=False)
        else:
            self.console.print(f"unknown command {name}. {_HELP}", markup=False)

    def _decide(self, approve: bool, argument: str) -> None:
        """``/approve ID [NOTE]`` / ``/reject ID [NOTE]``: the person at the terminal decides
        as an operator (``Agent.decide``); the turn that goes on is shown."""
        approval_id, _, note = argument.partition(" ")
        if not approval_id:
            verb = "/approve" if approve else "/reject"
            self.console.print(f"usage: {verb} ID [NOTE] (the id the waiting call shows)")
            return
        decided = self.agent.decide(
            self.session, approval_id, approve=approve, by=_DECIDER, note=note.strip() or None
        )
        try:
            reply = self._runner.run(decided)
        except KeyboardInterrupt:
            self.console.print("\n[dim](interrupted: /state shows where the session is)[/]")
            return
        except KeelError as exc:
            self.console.print(f"[red]error:[/] {exc}", highlight=False)
            return
        self.last_run = reply.run_id
        self.console.print(f"[dim]({'approved' if approve else 'rejected'} {approval_id})[/]")
        self.console.print("[bold]agent>[/] ", end="")
        self._show(reply.text + "\n")
        self._show_waiting(reply)

    def _state(self, *, every: bool) -> None:
        state = self.agent.session_state(self.session)
        if state is None:
            self.console.print("(no state yet: say something first)")
            return
        payload = state.model_dump(mode="json")
        total = len(payload["messages"])
        if not every:
            payload["messages"] = payload["messages"][-STATE_MESSAGES_SHOWN:]
        self.console.print_json(json.dumps(payload, default=str))
        shown = len(payload["messages"])
        hint = "" if shown == total else "; /state all shows every one"
        self.console.print(f"(the session holds {total} messages, {shown} shown above{hint})")

    def _memory(self, query: str) -> None:
        long_term = self.agent.memory
        if long_term is None:
            self.console.print("memory is off (--no-memory)")
            return
        from keel.memory import Scope  # lazy as in _build (loaded by the agent by now)

        long_term.flush()
        packed = long_term.retrieve(
            query, scope=Scope(tenant_id=self.agent.tenant_id, user_id=self.user), budget_tokens=400
        )
        self.console.print(packed.text or "(nothing relevant remembered)", markup=False)

    def _trace(self) -> None:
        from keel.tracing import RunQuery  # lazy as in _build (loaded by the agent by now)

        assert self.agent.backends is not None  # Agent.open keeps what it opened
        traces = self.agent.backends.traces
        runs = traces.list_runs(RunQuery(session_id=self.session, limit=1))
        if not runs:
            self.console.print("(no runs yet)")
            return
        detail = traces.get_run_detail(runs[0].run_id)
        for step in detail.steps if detail is not None else ():
            self.console.print(
                f"  {step.kind:<10} {step.name:<28} tokens {step.prompt_tokens}"
                f"+{step.completion_tokens}  {step.latency_ms or 0:.0f} ms",
                markup=False,
            )


def _read_line() -> str | None:
    """The next line the user typed (a prompt on a terminal); None at the end of input."""
    if not sys.stdin.isatty():
        return sys.stdin.readline() or None
    try:
        return input("you> ")
    except EOFError:
        return None


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
            "else keel.db in the data directory). KEEL_REDIS_URL keeps state on Redis. A "
            "SQLite file must exist unless it is the default one or --create is given.",
        ),
    ] = None,
    create: CreateOption = False,
) -> None:
    """Chat with an agent whose memory and state survive restarts (same --session)."""
    agent = _build(model, memory, database, create=create)
    Chat(agent, session, user, out_console).run(_read_line)
