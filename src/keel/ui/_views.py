"""What the run and session pages compute from a trace before drawing it: the messages a
model step was sent mapped to the token bar's sections, a run's waterfall (where its time
went), the session's conversation as the user had it, and the search over runs by text and
tool. Plain data; the templates draw it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from keel.context._engine import MEMORIES_HEADING, RULES_HEADING, SUMMARY_HEADING
from keel.messages import Message
from keel.tools._journal import SETTLED_NOTE
from keel.tracing import Run, RunDetail, RunQuery, Step, TraceStore
from keel.ui._diff import parsed_json

__all__ = [
    "SEARCH_SCAN",
    "PromptMessage",
    "Span",
    "Timeline",
    "Turn",
    "json_view",
    "other_attributes",
    "prompt_messages",
    "search_runs",
    "session_turns",
    "timeline",
]


def other_attributes(step: Step) -> dict[str, Any]:
    """``step``'s attributes but the prompt, which the page shows as messages."""
    return {key: value for key, value in step.attributes.items() if key != "prompt"}


def json_view(value: Any) -> str:
    """``value`` as indented JSON; a string that holds JSON (tool arguments as the model sent
    them) is parsed first, so that it shows as JSON rather than as an escaped string."""
    if isinstance(value, str):
        text: str = value
        try:
            value = json.loads(text)
        except ValueError:
            return text
    return json.dumps(parsed_json(value), indent=2, ensure_ascii=False)


@dataclass(frozen=True)
class PromptMessage:
    """One message a model call was sent, with the token bar's section it counts in."""

    section: str
    role: str
    content: str
    tool_calls: tuple[str, ...] = ()
    """``name(arguments)`` per tool call of an assistant message."""
    tool_call_id: str | None = None


def _section(index: int, role: str, content: str) -> str:
    if role == "system":
        if content.startswith(MEMORIES_HEADING):
            return "memories"
        if content.startswith(SUMMARY_HEADING):
            return "summary"
        if content.startswith(RULES_HEADING):
            return "rules"
        if index == 0:
            return "system"
    return "turns"


def _prompt_message(index: int, wire: dict[str, Any]) -> PromptMessage:
    role, content = str(wire.get("role", "")), wire.get("content") or ""
    content = content if isinstance(content, str) else json.dumps(content)
    calls = tuple(
        f"{call.get('function', {}).get('name', '')}"
        f"({call.get('function', {}).get('arguments', '')})"
        for call in wire.get("tool_calls") or ()
        if isinstance(call, dict)
    )
    section = _section(index, role, content)
    if isinstance(wire.get("cut_chars"), int):
        content += f"\n[... {wire['cut_chars']:,} more characters were sent, not kept]"
    return PromptMessage(section, role, content, calls, wire.get("tool_call_id"))


def prompt_messages(step: Step, stored: Sequence[Message] | None) -> list[PromptMessage]:
    """The messages ``step`` (a model call) was sent, as the trace keeps them (masked), each
    with its section: the compiler's layout (system prompt first, then the memories and
    summary blocks, the turns, the rules block before the newest user message) tells them
    apart by position and heading. A run of the session's messages the trace names by
    position (see ``keel.tracing._loop.prompt_record``) is read from
    ``stored``, the session's messages at the step's checkpoint. Empty for a trace recorded
    before prompts were kept."""
    shown: list[PromptMessage] = []
    for entry in step.attributes.get("prompt") or ():
        if not isinstance(entry, dict):
            continue
        if "messages" not in entry:
            shown.append(_prompt_message(len(shown), entry))
            continue
        first, last = entry["messages"]
        for position in range(first, last + 1):
            if stored is not None and position < len(stored):
                shown.append(_prompt_message(len(shown), stored[position].to_openai()))
            else:
                missing = f"(message {position} of the session: no longer stored)"
                shown.append(PromptMessage("turns", "?", missing))
    return shown


@dataclass(frozen=True)
class Span:
    """One bar of a run's waterfall, in milliseconds from the run's start."""

    kind: str
    name: str
    start_ms: float
    duration_ms: float
    depth: int
    step_id: str
    ttft_ms: float | None = None
    failed: bool = False
    note: str = ""


@dataclass(frozen=True)
class Timeline:
    """A run's steps laid out in time, and where its time went."""

    total_ms: float
    spans: tuple[Span, ...]
    model_ms: float
    tool_ms: float
    first_token_ms: float
    """Time to the first token, summed over the model calls that streamed."""
    markers: tuple[Span, ...] = ()
    """Instants: checkpoints written, guard events, workflow moves."""

    @property
    def keel_ms(self) -> float:
        """What neither the model nor the tools took: context, checkpoints, memory, traces."""
        return max(self.total_ms - self.model_ms - self.tool_ms, 0.0)


def _ms(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds() * 1000


def timeline(detail: RunDetail, checkpoints: Sequence[tuple[datetime, str]] = ()) -> Timeline:
    """``detail``'s waterfall. A loop step's model call and its tool calls are written
    together once the tools have run, so their spans are laid back from that moment: the
    tools end there one after the other, each taking its measured time, and the model call
    ends as the first tool starts. Checkpoints (``(when, label)``), guard events and workflow
    moves are instants."""
    run = detail.run
    end = run.ended_at or max(
        (step.ended_at or step.started_at for step in detail.steps), default=run.started_at
    )
    total = max(_ms(end, run.started_at), 0.0)
    children: dict[str, list[Step]] = {}
    for step in detail.steps:
        if step.parent_id:
            children.setdefault(step.parent_id, []).append(step)
    spans: list[Span] = []
    markers: list[Span] = []
    model_ms = tool_ms = first_ms = 0.0
    for step in detail.steps:
        if step.kind == "model":
            finish = _ms(step.ended_at or step.started_at, run.started_at)
            tools = [child for child in children.get(step.step_id, []) if child.kind == "tool"]
            laid: list[Span] = []
            for tool in reversed(tools):
                took = tool.latency_ms or 0.0
                finish -= took
                tool_ms += took
                laid.append(
                    Span(
                        "tool",
                        tool.name,
                        max(finish, 0.0),
                        took,
                        1,
                        tool.step_id,
                        failed=tool.failed,
                    )
                )
            took = step.latency_ms or 0.0
            model_ms += took
            first_ms += step.ttft_ms or 0.0
            spans.append(
                Span(
                    "model",
                    step.name,
                    max(finish - took, 0.0),
                    took,
                    0,
                    step.step_id,
                    ttft_ms=step.ttft_ms,
                    failed=step.failed,
                    note=step.error_type or "",
                )
            )
            spans.extend(reversed(laid))
        elif step.kind in ("guard", "transition", "reset", "checkpoint"):
            at = max(_ms(step.started_at, run.started_at), 0.0)
            note = step.error_message or ""
            markers.append(
                Span(
                    step.kind,
                    step.name,
                    min(at, total),
                    0.0,
                    0,
                    step.step_id,
                    failed=step.failed,
                    note=note,
                )
            )
    for when, label in checkpoints:
        at = _ms(when, run.started_at)
        if 0 <= at <= total:
            markers.append(Span("checkpoint", label, at, 0.0, 0, ""))
    markers.sort(key=lambda span: span.start_ms)
    return Timeline(total, tuple(spans), model_ms, tool_ms, first_ms, tuple(markers))


@dataclass
class Turn:
    """One entry of the conversation as the user had it: a turn (a run), a side-effecting
    tool call the journal kept, or an approval asked of an operator."""

    kind: str
    at: datetime | float
    run: Run | None = None
    resumed: bool = False
    """This run finished a turn an earlier run of the session left interrupted."""
    title: str = ""
    detail: str = ""
    status: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def session_turns(
    runs: Sequence[Run], journal: Sequence[Any], approvals: Sequence[Any]
) -> list[Turn]:
    """The session's runs (oldest first; a run after an interrupted one with the same input
    is its resumption), the journalled tool calls (in doubt, settled by an operator, done)
    and the approvals, in the order they happened."""
    entries: list[tuple[float, int, Turn]] = []
    open_inputs: set[str] = set()
    for order, run in enumerate(sorted(runs, key=lambda item: item.started_at)):
        resumed = (run.input or "") in open_inputs
        if run.status == "interrupted":
            open_inputs.add(run.input or "")
        elif resumed:
            open_inputs.discard(run.input or "")
        entries.append(
            (
                run.started_at.timestamp(),
                order,
                Turn("turn", run.started_at, run, resumed, status=run.status),
            )
        )
    for entry in journal:
        if entry.in_doubt:
            status = "in doubt"
        elif (entry.output or "").startswith(SETTLED_NOTE):
            status = "in doubt, settled by an operator" + ("" if entry.ok else ": not done")
        else:
            status = "done" if entry.ok else "failed"
        entries.append(
            (
                entry.started_at,
                0,
                Turn(
                    "tool",
                    entry.started_at,
                    title=entry.tool,
                    detail=entry.arguments,
                    status=status,
                    extra={"entry": entry},
                ),
            )
        )
    for request in approvals:
        decision = request.decision
        detail = request.reason or ""
        entries.append(
            (
                request.created_at,
                0,
                Turn(
                    "approval",
                    request.created_at,
                    title=request.tool or "escalated turn",
                    detail=detail,
                    status=request.status,
                    extra={"request": request, "decision": decision},
                ),
            )
        )
    entries.sort(key=lambda item: (item[0], item[1]))
    return [turn for _, _, turn in entries]


SEARCH_SCAN = 5_000
"""The most runs one search reads (newest first); the page says when it stopped there."""

_SCAN_PAGE = 500


def search_runs(
    traces: TraceStore,
    query: RunQuery,
    text: str,
    tool: str,
    tool_runs: Callable[[], set[str]],
    wanted: int,
) -> tuple[list[Run], bool]:
    """Runs matching ``query`` whose input or output holds ``text`` (any case) and that called
    ``tool`` (run ids from ``tool_runs``), newest first: up to ``wanted``, scanning at most
    [`SEARCH_SCAN`][keel.ui._views.SEARCH_SCAN] runs. The flag says the scan stopped there."""
    needle = text.casefold()
    called = tool_runs() if tool else None
    found: list[Run] = []
    scanned = 0
    until = query.until
    while len(found) < wanted and scanned < SEARCH_SCAN:
        page = traces.list_runs(query.model_copy(update={"until": until, "limit": _SCAN_PAGE}))
        scanned += len(page)
        for run in page:
            if called is not None and run.run_id not in called:
                continue
            if needle and needle not in f"{run.input or ''}\n{run.output or ''}".casefold():
                continue
            found.append(run)
            if len(found) == wanted:
                break
        if len(page) < _SCAN_PAGE:
            return found, False
        until = page[-1].started_at
    return found, len(found) < wanted
