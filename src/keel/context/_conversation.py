"""The conversation history as the context engine holds it: turns, cached counts, a summary.

A [`Conversation`][] is incremental. Each message is counted once, when it is added; each
turn keeps its exact size raw and with older tool output pruned, and the conversation keeps
running totals, so compiling a prompt never recounts the history.

History is grouped into *turns*, the atomic units of the window: a user message, an
assistant message without tool calls, a system notice, or an assistant message with tool
calls together with all of its tool results. A turn is kept, dropped or summarized whole, so
a prompt never holds a tool result without its call or a call without its results.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_sync
from keel.context._budget import PruningPolicy, SummaryPolicy
from keel.context._memory import MemorySink
from keel.context._notes import is_runtime_note
from keel.context._summarize import Summarizer, SummaryRequest
from keel.context._text import cut_middle
from keel.errors import UsageError
from keel.messages import Message
from keel.privacy import message_placeholders
from keel.tokens import ChatTokenCounter

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Conversation", "SummaryOutcome", "Turn"]


_CutHow = Literal["pruned", "pruned_hard", "elided"]


@dataclass(frozen=True, slots=True)
class _Form:
    """One way of sending a message: the message itself, its exact token cost, and the
    placeholders it shows the model (found once, when the form is made)."""

    message: Message
    tokens: int
    content_tokens: int
    how: _CutHow | None
    placeholders: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placeholders", message_placeholders(self.message))


class Turn:
    """An atomic unit of history (see the module docstring); sizes are cached, never recounted."""

    __slots__ = (
        "_elided",
        "_hard",
        "forms",
        "pending",
        "pruned_total",
        "raw",
        "raw_total",
        "seq",
    )

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.raw: list[_Form] = []
        self.forms: list[_Form] = []  # pruned form (same object as raw when not pruned)
        self._hard: list[_Form] | None = None
        self._elided: dict[tuple[int, int, str], _Form] = {}
        self.pending: set[str] = set()
        self.raw_total = 0
        self.pruned_total = 0

    @property
    def messages(self) -> list[Message]:
        """The turn's messages as added."""
        return [form.message for form in self.raw]

    @property
    def is_user(self) -> bool:
        """Whether this turn is a user message."""
        return self.raw[0].message.role == "user"

    @property
    def complete(self) -> bool:
        """False while tool calls of this turn still wait for their results."""
        return not self.pending

    def hard_forms(self, conversation: Conversation) -> list[_Form]:
        """Forms with tool results cut to the hard pruning threshold (degradation step 1)."""
        if self._hard is None:
            limit = conversation.pruning.hard_max_tokens
            self._hard = [
                conversation._pruned_form(form, limit, "pruned_hard")
                if form.message.role == "tool"
                else form
                for form in self.raw
            ]
        return self._hard

    def cut_form(
        self, conversation: Conversation, position: int, target: int, how: _CutHow = "elided"
    ) -> _Form:
        """Message ``position`` with its middle cut to ``target`` content tokens (cached)."""
        key = (position, target, how)
        form = self._elided.get(key)
        if form is None:
            if len(self._elided) >= 8:
                self._elided.clear()
            form = conversation._cut_form(self.raw[position], target, how)
            self._elided[key] = form
        return form

    def __repr__(self) -> str:
        roles = ",".join(form.message.role for form in self.raw)
        return f"Turn(seq={self.seq}, roles={roles}, tokens={self.raw_total})"


class _PrunedHistory:
    """The held turns as older turns are sent (tool output pruned), flattened.

    Past the recent messages and the floor, the window takes the held turns exactly in this
    form, newest first, while they fit: a contiguous run of turns. Running sums and one flat
    message list make that run one binary search and one slice, however long it is, so a
    compile costs what changed, not the window's size.

    Sums and message numbers count from the conversation's start: adding only touches the
    end of each list, and evicting the oldest turns only deletes the head.
    """

    __slots__ = (
        "_cut_at",
        "_cuts",
        "_marked_at",
        "_marks",
        "_messages",
        "_messages_before",
        "_pruned_before",
        "_raw_before",
    )

    def __init__(self) -> None:
        # Entry i is the total before held turn i; the last entry is the total of all.
        self._pruned_before = [0]
        self._raw_before = [0]
        self._messages_before = [0]
        self._messages: list[Message] = []
        # Message numbers of the forms that are cut, with their raw and cut forms: a prompt
        # reports each cut message, and most turns have none.
        self._cut_at: list[int] = []
        self._cuts: list[tuple[_Form, _Form]] = []
        # Message numbers of the forms that show placeholders, with them: a prompt notes
        # what it shows the model without scanning its messages again (most have none).
        self._marked_at: list[int] = []
        self._marks: list[frozenset[str]] = []

    @property
    def raw_tokens(self) -> int:
        """Tokens of all held turns as added."""
        return self._raw_before[-1] - self._raw_before[0]

    @property
    def pruned_tokens(self) -> int:
        """Tokens of all held turns, tool output pruned."""
        return self._pruned_before[-1] - self._pruned_before[0]

    def open_turn(self) -> None:
        """A new, empty newest turn."""
        self._pruned_before.append(self._pruned_before[-1])
        self._raw_before.append(self._raw_before[-1])
        self._messages_before.append(self._messages_before[-1])

    def append(self, raw: _Form, pruned: _Form) -> None:
        """One message of the newest turn, raw and as it is sent once older."""
        if pruned.how is not None:
            self._cut_at.append(self._messages_before[-1])
            self._cuts.append((raw, pruned))
        if pruned.placeholders:
            self._marked_at.append(self._messages_before[-1])
            self._marks.append(pruned.placeholders)
        self._messages.append(pruned.message)
        self._messages_before[-1] += 1
        self._pruned_before[-1] += pruned.tokens
        self._raw_before[-1] += raw.tokens

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest turns (summarized)."""
        end = self._messages_before[count]
        del self._messages[: end - self._messages_before[0]]
        cuts = bisect_left(self._cut_at, end)
        del self._cut_at[:cuts]
        del self._cuts[:cuts]
        marked = bisect_left(self._marked_at, end)
        del self._marked_at[:marked]
        del self._marks[:marked]
        del self._pruned_before[:count]
        del self._raw_before[:count]
        del self._messages_before[:count]

    def fit_start(self, stop: int, room: int) -> int:
        """The oldest turn from which turns up to ``stop`` (excluded) fit ``room`` tokens."""
        return bisect_left(self._pruned_before, self._pruned_before[stop] - room, 0, stop)

    def pruned_tokens_of(self, turns: range) -> int:
        """Tokens of a run of held turns, tool output pruned."""
        return self._pruned_before[turns.stop] - self._pruned_before[turns.start]

    def raw_tokens_of(self, turns: range) -> int:
        """Tokens of a run of held turns as added."""
        return self._raw_before[turns.stop] - self._raw_before[turns.start]

    def messages(self, turns: range) -> list[Message]:
        """The messages of a run of held turns, tool output pruned (a new list, the
        caller's)."""
        base = self._messages_before[0]
        before = self._messages_before
        return self._messages[before[turns.start] - base : before[turns.stop] - base]

    def placeholders(self, turns: range) -> frozenset[str]:
        """The placeholders the messages of a run of held turns show, tool output pruned."""
        before = self._messages_before
        low = bisect_left(self._marked_at, before[turns.start])
        high = bisect_left(self._marked_at, before[turns.stop], low)
        if low == high:
            return frozenset()
        return frozenset().union(*self._marks[low:high])

    def first_message(self, turn: int) -> int:
        """The number of held turn ``turn``'s first message, counted from the conversation's
        first message (summarized ones included)."""
        return self._messages_before[turn]

    def cuts(self, turns: range) -> list[tuple[int, _Form, _Form]]:
        """The cut messages of a run of held turns: position in the run, raw and cut form."""
        first = self._messages_before[turns.start]
        low = bisect_left(self._cut_at, first)
        high = bisect_left(self._cut_at, self._messages_before[turns.stop], low)
        return [
            (self._cut_at[k] - first, raw, cut)
            for k, (raw, cut) in enumerate(self._cuts[low:high], low)
        ]


class SummaryOutcome(BaseModel):
    """What one summarization attempt did."""

    model_config = ConfigDict(frozen=True)

    committed: bool = Field(description="True when the new summary replaced the old turns.")
    turns: int = Field(description="Turns the attempt covered (evicted when committed).")
    messages: int = Field(description="Messages in those turns.")
    tokens_evicted: int = Field(description="Raw tokens of those turns.")
    summary_tokens: int = Field(description="Tokens of the running summary afterwards.")
    resummarized: bool = Field(
        default=False, description="The merged summary passed its cap and was condensed again."
    )
    elapsed_ms: float = Field(description="Wall time of the attempt.")
    error: str | None = Field(
        default=None, description="Why it was not committed (the turns stay raw)."
    )


class Conversation:
    """One session's history for the context engine. Create it with ``engine.conversation()``.

    Add messages with [`add`][] as they happen; call [`asummarize`][] (or its sync twin
    [`summarize`][]) between turns, off the hot path, to fold the oldest turns into the
    running summary once the history passes the trigger of the [`SummaryPolicy`][].
    """

    def __init__(
        self,
        session_id: str,
        counter: ChatTokenCounter,
        *,
        pruning: PruningPolicy,
        summary_policy: SummaryPolicy,
        summarizer: Summarizer,
        summary_cap: int,
        turns_budget: int,
        memory_sink: MemorySink | None = None,
    ) -> None:
        self.session_id = session_id
        self.counter = counter
        self.pruning = pruning
        self.summary_policy = summary_policy
        self.summarizer = summarizer
        self.summary_cap = summary_cap
        self.memory_sink = memory_sink
        self.turns_budget = turns_budget
        """Tokens the recent turns may take, as of the last compiled prompt."""
        self._turns: list[Turn] = []
        self._open: Turn | None = None
        self._next_seq = 0
        self._pruned_history = _PrunedHistory()
        self._message_count = 0
        self._last_user_seq: int | None = None
        self._summary = ""
        self._summary_tokens = 0
        self._turns_summarized = 0
        self._messages_summarized = 0
        self._summarizing = False
        self._window_start_seq = 0  # oldest turn in the last compiled window
        self.summarize_outside_window = summary_policy.summarize_outside_window

    # --- reading -----------------------------------------------------------------------

    @property
    def turns(self) -> Sequence[Turn]:
        """The turns held raw (not yet summarized), oldest first."""
        return tuple(self._turns)

    @property
    def messages(self) -> list[Message]:
        """The messages held raw, oldest first (summarized ones are in [`summary`][])."""
        return [message for turn in self._turns for message in turn.messages]

    def __len__(self) -> int:
        return self._message_count

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    @property
    def summary(self) -> str:
        """The running summary of the turns evicted so far ('' before the first)."""
        return self._summary

    @property
    def summary_tokens(self) -> int:
        """Tokens of the running summary's text."""
        return self._summary_tokens

    @property
    def turns_summarized(self) -> int:
        """How many turns have been folded into the summary."""
        return self._turns_summarized

    @property
    def raw_tokens(self) -> int:
        """Tokens of the raw history (framing included), kept as a running total."""
        return self._pruned_history.raw_tokens

    @property
    def pruned_tokens(self) -> int:
        """Tokens of the raw history as older turns appear in a prompt (tool output pruned)."""
        return self._pruned_history.pruned_tokens

    @property
    def needs_summary(self) -> bool:
        """Whether the history has passed the summary trigger (O(1))."""
        policy = self.summary_policy
        if policy.max_turns is not None and len(self._turns) > policy.max_turns:
            return bool(self._evictable_count())
        if self._pruned_history.pruned_tokens > policy.trigger_ratio * self.turns_budget:
            return bool(self._evictable_count())
        outside = bool(self._turns) and self._turns[0].seq < self._window_start_seq
        if self.summarize_outside_window and outside:
            # The last prompt left turns out that no summary covers yet: fold them in.
            return bool(self._evictable_count())
        return False

    def window_messages(self) -> Iterator[Message]:
        """The held messages from the oldest turn of the last compiled prompt's window on
        (every held message before the first compile), oldest first, with those added since:
        what the next prompt shows verbatim while its window stays where it was. Lazy: a
        caller that stops at the first message it needs reads only that far."""
        turns = self._turns
        start = max(0, self._window_start_seq - turns[0].seq) if turns else 0
        for index in range(start, len(turns)):
            for form in turns[index].raw:
                yield form.message

    def newest_user_index(self) -> int | None:
        """Index in [`turns`][] of the newest user message's turn, or None."""
        if self._last_user_seq is None or not self._turns:
            return None
        index = self._last_user_seq - self._turns[0].seq
        return index if index >= 0 else None

    # --- writing -----------------------------------------------------------------------

    def add(self, message: Message) -> None:
        """Append one message; it is counted now, once.

        Raises:
            UsageError: a tool result for a call that is not waiting for one, or a new
                message while tool calls still wait for results (add their results first,
                as error texts if the tools failed).
        """
        form = self._raw_form(message)
        if message.role == "tool":
            turn = self._open
            if turn is None or message.tool_call_id not in turn.pending:
                raise UsageError(
                    f"tool result for call {message.tool_call_id!r}, which no assistant message "
                    "in the current turn is waiting for"
                )
            turn.pending.discard(message.tool_call_id or "")
            if not turn.pending:
                self._open = None
        else:
            if self._open is not None:
                waiting = ", ".join(sorted(self._open.pending))
                raise UsageError(
                    f"tool calls {waiting} have no results yet; add a tool message for each "
                    "(an error text if the tool failed) before the next message"
                )
            turn = Turn(self._next_seq)
            self._next_seq += 1
            self._turns.append(turn)
            self._pruned_history.open_turn()
            if message.tool_calls:
                ids = [call.id for call in message.tool_calls]
                if len(set(ids)) != len(ids):
                    raise UsageError(f"duplicate tool call ids in one message: {ids}")
                turn.pending = set(ids)
                self._open = turn
            if message.role == "user":
                self._last_user_seq = turn.seq
        pruned = (
            self._pruned_form(form, self.pruning.max_tokens, "pruned")
            if message.role == "tool"
            else form
        )
        turn.raw.append(form)
        turn.forms.append(pruned)
        turn._hard = None
        turn.raw_total += form.tokens
        turn.pruned_total += pruned.tokens
        self._pruned_history.append(form, pruned)
        self._message_count += 1

    def extend(self, messages: Iterable[Message]) -> None:
        """Append several messages in order."""
        for message in messages:
            self.add(message)

    def _raw_form(self, message: Message) -> _Form:
        tokens, content_tokens = self.counter.count_message_content(message)
        return _Form(message, tokens, content_tokens, None)

    def _pruned_form(self, form: _Form, limit: int, how: _CutHow) -> _Form:
        """``form`` with its content cut to ``limit`` tokens (itself when it is not larger)."""
        if form.content_tokens <= limit:
            return form
        return self._cut_form(form, limit, how)

    def _cut_form(self, form: _Form, target: int, how: _CutHow) -> _Form:
        """The raw ``form`` with its content's middle cut to ``target`` tokens, marker stated."""
        message = form.message
        original = form.content_tokens
        text, content_tokens = cut_middle(
            self.counter.tokenizer,
            message.content,
            target,
            original_tokens=original,
            kind="prune" if how.startswith("pruned") else "elide",
        )
        metadata = {**message.metadata, "keel_cut": {"how": how, "original_tokens": original}}
        cut = message.model_copy(update={"content": text, "metadata": metadata})
        framing = form.tokens - original
        if self.counter.profile.chat_format == "openai":
            # OpenAI framing is additive: the message costs its framing plus its content.
            tokens = framing + content_tokens
        else:
            tokens = self.counter.count_message(cut)
        return _Form(cut, tokens, max(0, tokens - framing), how)

    def _restore_summary(self, summary: str, turns_summarized: int) -> None:
        """Set the running summary of a resumed session (before any message is added)."""
        self._summary = summary
        self._summary_tokens = self.counter.count_text(summary)
        self._turns_summarized = turns_summarized

    # --- summarizing -------------------------------------------------------------------

    def _evictable_count(self) -> int:
        """How many of the oldest turns may be summarized (never the floor or current turn)."""
        limit = len(self._turns) - self.summary_policy.keep_turns
        newest_user = self.newest_user_index()
        if newest_user is not None:
            limit = min(limit, newest_user)
        if self._open is not None:
            limit = min(limit, len(self._turns) - 1)
        return max(0, limit)

    def _select_eviction(self, force: bool) -> list[Turn]:
        policy = self.summary_policy
        evictable = self._evictable_count()
        target = policy.target_ratio * self.turns_budget
        remaining = self._pruned_history.pruned_tokens
        count = len(self._turns)
        chosen: list[Turn] = []
        for turn in self._turns[:evictable]:
            over_tokens = remaining > target
            over_turns = policy.max_turns is not None and count > policy.max_turns
            outside = self.summarize_outside_window and turn.seq < self._window_start_seq
            if not (over_tokens or over_turns or outside or force):
                break
            chosen.append(turn)
            remaining -= turn.pruned_total
            count -= 1
        return chosen

    async def asummarize(self, *, force: bool = False) -> SummaryOutcome | None:
        """Fold the oldest turns into the running summary, if the trigger has been passed.

        With ``force`` every turn that may be evicted is summarized now. Returns None when
        there was nothing to do. A failed, timed-out or cancelled summary, or a memory sink
        that raises, commits nothing: the turns stay raw and the next call tries again.
        """
        if self._summarizing or not (force or self.needs_summary):
            return None
        chosen = self._select_eviction(force)
        if not chosen:
            return None
        self._summarizing = True
        started = time.perf_counter()
        messages = [message for turn in chosen for message in turn.messages]
        # keel's own notes are folded away with their turns, never summarized: a summary
        # goes to the prompt and to long-term memory as what was said.
        said = tuple(message for message in messages if not is_runtime_note(message))

        def outcome(**fields: Any) -> SummaryOutcome:
            return SummaryOutcome(
                turns=len(chosen),
                messages=len(messages),
                tokens_evicted=sum(turn.raw_total for turn in chosen),
                elapsed_ms=(time.perf_counter() - started) * 1000,
                **fields,
            )

        resummarized = False
        try:
            summary = await self._summarize_once(self._summary, said)
            # By lines (exact): a summary repeats the last one's lines, counted before.
            summary_tokens = self.counter.count_lines(summary)
            if summary_tokens > self.summary_cap:
                resummarized = True
                summary, summary_tokens = await self._condense(summary)
            if not summary.strip() and self._summary.strip():
                raise ValueError("the summarizer returned an empty summary")
            if self.memory_sink is not None:
                await self.memory_sink.archive(self.session_id, said, summary)
        except Exception as exc:  # any failure leaves the raw turns in place
            return outcome(
                committed=False,
                summary_tokens=self._summary_tokens,
                resummarized=resummarized,
                error=f"{type(exc).__name__}: {exc}",
            )
        finally:
            self._summarizing = False
        if not self._turns or self._turns[0] is not chosen[0]:
            return outcome(
                committed=False,
                summary_tokens=self._summary_tokens,
                error="the history changed while summarizing",
            )
        del self._turns[: len(chosen)]
        self._pruned_history.drop_oldest(len(chosen))
        self._message_count -= len(messages)
        self._summary = summary
        self._summary_tokens = summary_tokens
        self._turns_summarized += len(chosen)
        self._messages_summarized += len(messages)
        return outcome(committed=True, summary_tokens=summary_tokens, resummarized=resummarized)

    async def _summarize_once(self, previous: str, messages: tuple[Message, ...]) -> str:
        """One call of the summarizer, within the policy's timeout."""
        request = SummaryRequest(
            previous=previous, messages=messages, max_tokens=self.summary_cap, counter=self.counter
        )
        return await asyncio.wait_for(
            self.summarizer.summarize(request), self.summary_policy.timeout_s
        )

    async def _condense(self, summary: str) -> tuple[str, int]:
        """A merged summary over its cap, summarized again alone; cut to the cap if it still
        does not fit. The summary and its tokens."""
        condensed = await self._summarize_once(summary, ())
        tokens = self.counter.count_text(condensed)
        if tokens <= self.summary_cap:
            return condensed, tokens
        return cut_middle(
            self.counter.tokenizer,
            condensed,
            self.summary_cap,
            original_tokens=tokens,
            kind="elide",
        )

    @property
    def messages_summarized(self) -> int:
        """How many messages this conversation has folded into the summary since it was created
        (a resumed session adds the count it was restored with)."""
        return self._messages_summarized

    def summarize(self, *, force: bool = False) -> SummaryOutcome | None:
        """Sync twin of [`asummarize`][] (not for use inside a running event loop)."""
        if not force and not self.needs_summary:
            return None
        return run_sync(self.asummarize(force=force))

    def __repr__(self) -> str:
        return (
            f"Conversation({self.session_id!r}, turns={len(self._turns)}, "
            f"tokens={self.raw_tokens}, summarized_turns={self._turns_summarized})"
        )
