"""``keel chat`` through its own loop (``Chat.run``) on a real embedded agent: Ctrl-C in the
middle of a reply, the note on the bundled demo model, ``/state``, ``/approve`` and
``/reject``."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from rich.console import Console

from keel.cli._chat import Chat
from keel.messages import Message
from keel.models import CompletionChunk, ModelOptions, ToolSchema
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, tool
from keel.tracing import RunQuery
from tests.cli import keel_process


class _CtrlCMidReply(ScriptedModel):
    """Answers ``Re: <message>`` (or ``answer``); its streamed reply number ``story_at`` is a
    story that stops once the user has seen its first words and presses Ctrl-C (a real SIGINT
    to this process, as the terminal sends it)."""

    def __init__(self, answer: Callable[[ScriptedCall], Any] | None = None, story_at: int = 0):
        super().__init__(answer or (lambda call: f"Re: {call.last_user_text}"))
        self.streamed = 0
        self.story_at = story_at
        self.screen = io.StringIO()

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        self.streamed += 1
        if self.streamed - 1 == self.story_at:
            # Longer than what masking holds back from the end of a stream (64 characters).
            yield CompletionChunk(text="Once upon a time there was a keel. " * 4)
            deadline = time.monotonic() + 60
            while "Once upon a" not in self.screen.getvalue():
                assert time.monotonic() < deadline, "the reply's first words were never shown"
                await asyncio.sleep(0.01)
            # To the process, as a terminal sends it (the kernel hands it to a thread that
            # does not block it): raise_signal would aim it at this thread, the bridge's, and
            # a bridge thread started by a thread that blocks SIGINT would hold it pending.
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.Event().wait()  # the reply would go on; Ctrl-C stops it here
        async for chunk in super()._astream(messages, tools, options):
            yield chunk


def _lines(*lines: str) -> Callable[[], str | None]:
    queue = list(lines)
    return lambda: queue.pop(0) if queue else None


def _chat(model: ScriptedModel, *lines: str, tools: Sequence[Tool] = ()) -> str:
    agent = Agent.open(
        model=model, system_prompt="You are brief.", tools=tools, memory=False, name="chat"
    )
    output = model.screen if isinstance(model, _CtrlCMidReply) else io.StringIO()
    console = Console(file=output, width=200, highlight=False, soft_wrap=True)
    # Ctrl-C as at a terminal: a run started in the background (``make test &``, nohup)
    # inherits SIGINT ignored, and then no Ctrl-C reaches any program.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        Chat(agent, "s1", "u1", console).run(_lines(*lines))
    finally:
        signal.signal(signal.SIGINT, previous)
    return output.getvalue()


def test_ctrl_c_mid_reply_cancels_the_turn_and_the_next_message_is_answered_alone() -> None:
    model = _CtrlCMidReply()
    shown = _chat(model, "Tell me a story", "And then?")
    expected = [
        "agent> Once upon a",
        "(cancelled: that answer stops here, as the history says)",
        "agent> Re: And then?",
    ]
    positions = [shown.find(text) for text in expected]
    assert -1 not in positions and positions == sorted(positions), shown
    assert "finishing the interrupted turn" not in shown, shown
    # The story was never asked for again (the scripted model records the calls it answered:
    # the cancelled one never was), the new message was answered next...
    assert [call.last_user_text for call in model.calls] == ["And then?"]
    # ... the model seeing keel's note that the user cancelled the story.
    notes = [m.content for m in model.calls[0].messages if m.role == "system"]
    assert any("[cancelled]" in note for note in notes), notes


def test_ctrl_c_after_a_side_effect_keeps_it_in_the_history_before_the_cancellation() -> None:
    booked: list[str] = []

    @tool(side_effect=True)
    def book(seat: str) -> str:
        """Book a seat.

        Args:
            seat: The seat.
        """
        booked.append(seat)
        return f"booked {seat}"

    def answer(call: ScriptedCall) -> Any:
        if call.last_user_text.startswith("Book") and all(m.role != "tool" for m in call.messages):
            return ScriptedModel.tool_call("book", '{"seat": "4A"}')
        return f"Re: {call.last_user_text}"

    # The booking runs, then the answer about it is cancelled mid-sentence.
    model = _CtrlCMidReply(answer, story_at=1)
    shown = _chat(model, "Book seat 4A", "Is it booked?", "/state all", tools=[book])
    assert "(cancelled: that answer stops here" in shown and "agent> Re: Is it booked?" in shown
    assert booked == ["4A"]  # once: nothing finished the cancelled turn later
    # The next question's model call sees the booking, then keel's note, then the question.
    seen = [(m.role, m.content) for m in model.calls[-1].messages]
    assert ("tool", "booked 4A") in seen, seen
    note = next(i for i, (role, text) in enumerate(seen) if "[cancelled]" in text)
    assert seen.index(("tool", "booked 4A")) < note < seen.index(("user", "Is it booked?")), seen
    state = shown.partition("agent> Re: Is it booked?")[2]
    assert '"open_turn": null' in state and "[cancelled]" in state, state


def test_runs_of_a_chat_cancelled_by_ctrl_c_say_so_and_none_stays_running() -> None:
    _chat(_CtrlCMidReply(), "Tell me a story", "And then?")
    with Backends.open(load_settings(), memory=False) as backends:
        runs = backends.traces.list_runs(RunQuery(session_id="s1"))
    by_age = sorted(runs, key=lambda run: run.started_at)
    assert [run.status for run in by_age] == ["interrupted", "succeeded"]
    first = by_age[0]
    assert first.ended_at is not None and first.error_type == "CancelledError"
    assert first.error_message is not None and "cancelled by the user" in first.error_message
    assert "closed without an answer" in first.error_message
    assert by_age[1].attributes["resumed"] is False


def test_state_says_how_many_messages_there_are_and_how_to_see_all() -> None:
    turns = [f"message {n}" for n in range(4)]
    shown = _chat(ScriptedModel(lambda call: "ok"), *turns, "/state", "/state all")
    partial, _, every = shown.partition("(the session holds 8 messages, 6 shown above")
    assert "; /state all shows every one)" in every.splitlines()[0]
    assert "message 0" not in partial and "message 1" in partial
    assert "(the session holds 8 messages, 8 shown above)" in every
    assert "message 0" in every


def _keel_chat(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return keel_process("chat", "--no-memory", *args, stdin=stdin)


def test_chat_on_the_bundled_model_says_it_is_a_135m_demo_model() -> None:
    bundled = _keel_chat(stdin="/quit\n")
    assert bundled.returncode == 0, bundled.stderr
    head = " ".join(bundled.stdout.split())
    assert "local:smollm2" in head and "135M-parameter demo model" in head
    assert "KEEL_MODEL=openai:gpt-4o-mini" in head
    real = _keel_chat("-m", "scripted:echo", stdin="/quit\n")
    assert real.returncode == 0 and "KEEL_MODEL" not in real.stdout


def _told(call: ScriptedCall) -> str:
    """What the model was told last (keel's note on the decision), for its answer."""
    notes = [m.content for m in call.messages if m.role == "system" and "runtime note" in m.content]
    return "Told: " + (notes[-1] if notes else "nothing")


def _decided_in_chat(command: str) -> tuple[str, list[tuple[str, int]]]:
    """A chat whose refund waits for approval, then ``command ID note`` typed at the prompt:
    what it showed, and the refunds that ran."""
    refunds: list[tuple[str, int]] = []

    @tool(approval="operator")
    def refund(order: str, amount: int) -> str:
        """Refund part of an order.

        Args:
            order: The order id.
            amount: Euros to refund.
        """
        refunds.append((order, amount))
        return f"refunded {amount} EUR on {order}"

    call = ScriptedModel.tool_call("refund", '{"order": "W1", "amount": 50}')
    agent = Agent.open(
        model=ScriptedModel([call, _told]),
        system_prompt="You run a shop.",
        tools=[refund],
        memory=False,
        name="chat",
    )
    output = io.StringIO()
    console = Console(file=output, width=200, highlight=False, soft_wrap=True)
    lines = ["/help", "Refund 50 on W1.", command]

    def read_line() -> str | None:
        if len(lines) > 1:
            return lines.pop(0)
        waiting = re.search(rf"\(waiting: .*{command} (\S+) \[NOTE\]", output.getvalue())
        if waiting is None or not lines:
            return None
        return f"{lines.pop()} {waiting.group(1)} ok by policy"

    Chat(agent, "s1", "u1", console).run(read_line)
    return output.getvalue(), refunds


def test_approve_in_the_chat_decides_the_waiting_call_and_shows_the_turn_going_on() -> None:
    shown, refunds = _decided_in_chat("/approve")
    help_line = shown.splitlines()[1]
    assert help_line.startswith("Commands: "), shown
    assert "/approve ID [NOTE]" in help_line and "/reject ID [NOTE]" in help_line, shown
    found = re.search(r"\(waiting: refund needs approval; /approve (\S+) \[NOTE\]", shown)
    assert found is not None, shown
    approval = found.group(1)
    assert refunds == [("W1", 50)], shown
    _, _, after = shown.partition(f"(approved {approval})")
    assert "agent> Told:" in after, shown
    assert "approved by operator:chat (ok by policy); it ran: refunded 50 EUR" in after, shown
    with Backends.open(load_settings(), memory=False) as backends:
        stored = asyncio.run(backends.approvals.aget("default", approval))
    assert stored is not None and stored.status == "approved", stored
    assert stored.decision is not None and stored.decision.by == "operator:chat"
    assert stored.decision.note == "ok by policy"


def test_reject_in_the_chat_decides_the_waiting_call_and_it_never_runs() -> None:
    shown, refunds = _decided_in_chat("/reject")
    assert refunds == [], shown
    _, _, after = shown.partition("(rejected ")
    assert "rejected by operator:chat (ok by policy)" in after, shown
