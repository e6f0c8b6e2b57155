"""The prompt compiler: system prompt first, rules last before the newest user message.

Layout of every compiled prompt:

```text
[0]   system    the system prompt (identity, safety guardrails), verbatim
[1]   system    "Relevant memories ..." block                        (when any are kept)
[2]   system    "Summary of the earlier conversation ..." block      (when there is one)
...             older turns of the window, oldest first
[r]   system    "Operating rules ..." block                          (when rules are given)
[r+1] user      the newest user message
...             the current turn after it (assistant tool calls and their results)
```

Memories and summary are separate system messages with a clear heading rather than text
appended to the system prompt: the system prompt stays byte-identical from call to call (so
provider prompt caches keep hitting), and each block can be measured, capped and dropped on
its own. Rules sit right before the newest user message because instructions closest to the
end are followed most reliably; when the history has no user message they are last.

Windowing: turns (whole tool-call units) are taken newest first while they fit the
recent-turns budget (what system, rules, tools, memories and summary leave); the newest
``SummaryPolicy.keep_turns`` turns and the whole current turn are always taken. As plain
policy, not degradation, older tool results are pruned to ``PruningPolicy.max_tokens`` and a
recent one larger than ``PruningPolicy.recent_share`` of that budget is cut to that share,
so one giant output leaves room for the rest of the conversation. Past the recent messages
and the floor every turn is taken as held (tool output pruned): that run of older turns is
found by a binary search over the conversation's running sums and copied as one slice, so a
compile's cost does not grow with the window.

Degradation: when the preflight count (exact: messages, framing, reply priming and tool
schemas) still exceeds the prompt limit, these steps are tried in this order until it fits,
each one recorded in the [`BudgetReport`][]:

0. ``elide_oversized``: a message that alone is larger than the whole recent-turns budget
   (what system, rules, tools, memories and summary leave) can never be sent whole, so its
   middle is elided at once, to the share of that budget the other kept turns leave. Doing
   this first keeps one giant tool output or paste from pushing the summary and memories out
   (steps 3 and 4 could not make it fit whole anyway, only smaller).
1. ``prune_tools_harder``: tool results outside the current turn are cut to
   ``PruningPolicy.hard_max_tokens`` (oldest first).
2. (shrink the window) happens in the windowing itself: turns are taken newest first while
   they fit, so when the prompt overflows the window already holds only its floor
   (``SummaryPolicy.keep_turns`` newest turns and always the whole current turn); the turns
   left out are listed under ``dropped`` in the report, not as a degradation.
3. ``drop_memories``: memories are dropped, lowest-ranked first.
4. ``shorten_summary``: the summary's middle is elided (dropped when too little would stay).
5. ``elide_messages``: the middle of the largest messages (any of them, the newest user
   message included) is replaced by a marker, down to ``PruningPolicy.min_elided_tokens``.
6. ``drop_below_floor``: turns below the floor are dropped, oldest first; the newest user
   message is never dropped.

Only when the system prompt, the rules, the tool schemas and the newest user message cut to
its minimal form (``min_elided_tokens``) do not fit together is ``ContextOverflowError``
raised, naming each of those sections and its size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from keel.context._budget import ContextBudget, PruningPolicy, ResolvedBudget, SummaryPolicy
from keel.context._conversation import Conversation, Turn, _Form
from keel.context._memory import ContextMemory, MemorySink
from keel.context._report import (
    BudgetReport,
    DegradationName,
    DegradationStep,
    DroppedItem,
    PrunedOutput,
    SectionTokens,
)
from keel.context._summarize import ExtractiveSummarizer, Summarizer
from keel.context._text import cut_middle
from keel.errors import ContextOverflowError, UsageError
from keel.messages import Message
from keel.models import ChatModel
from keel.privacy import message_placeholders
from keel.tokens import ChatTokenCounter, counter_for

__all__ = ["CompiledPrompt", "ContextEngine", "render_prompt"]

ToolSchema = Mapping[str, Any]

MEMORIES_HEADING = "Relevant memories (from earlier sessions, most relevant first):"
SUMMARY_HEADING = "Summary of the earlier conversation (older turns, condensed):"
RULES_HEADING = "Operating rules (follow them in your next answer):"
_BLOCK_CACHE_SIZE = 512
_QUANTUM = 256


def render_prompt(messages: Sequence[Message]) -> str:
    """One string for a message list, for logs and completion-style models.

    Each message is a ``### role`` heading line followed by its content; tool calls are
    ``-> call NAME(ARGUMENTS) [id]`` lines and tool results are headed ``### tool [id]``.
    """
    parts: list[str] = []
    for message in messages:
        heading = f"### {message.role}"
        if message.role == "tool":
            heading += f" [{message.tool_call_id}]"
        elif message.name:
            heading += f" ({message.name})"
        body = [message.content] if message.content else []
        body.extend(
            f"-> call {call.name}({call.arguments}) [{call.id}]" for call in message.tool_calls
        )
        parts.append(heading + "\n" + "\n".join(body))
    return "\n\n".join(parts) + "\n\n### assistant\n"


@dataclass(frozen=True)
class CompiledPrompt:
    """A prompt ready to send: chat messages, the same as one string, and its budget report."""

    messages: tuple[Message, ...]
    """The chat messages, system prompt first."""
    tools: tuple[ToolSchema, ...]
    """The tool schemas counted with the prompt (send them with it)."""
    report: BudgetReport = field(repr=False)
    """Tokens per section and what was dropped, pruned or degraded, and why."""
    placeholders: frozenset[str] = field(default=frozenset(), repr=False)
    """The PII placeholders the messages show the model (in their content and their tool
    calls' arguments, see [`message_placeholders`][keel.privacy.message_placeholders]):
    each history message's were found once, when it was added, so noting what a prompt
    shows ([`PrivacyView.note_shown`][keel.privacy.PrivacyView.note_shown]) costs what is
    new, not the window."""
    held: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    """Where the messages show the conversation's own, as they were added (the very
    objects): runs of ``(index in messages, message number, length)``, the number counted
    from the conversation's first message (summarized ones included), each run as long as
    it goes on in both. Known from how the prompt was built, so a reader that follows the
    prompt against the stored history (the trace's record of it) need not compare the
    window item by item."""

    @property
    def tokens(self) -> int:
        """Exact tokens of the prompt (messages, framing, reply priming, tool schemas)."""
        return self.report.prompt_tokens

    @cached_property
    def text(self) -> str:
        """The prompt as one string (see [`render_prompt`][])."""
        return render_prompt(self.messages)

    def to_openai(self) -> list[dict[str, Any]]:
        """The messages in the OpenAI chat-completions wire format."""
        return [message.to_openai() for message in self.messages]


@dataclass(slots=True)
class _Entry:
    """One turn in the window being planned, with the forms chosen for its messages."""

    index: int
    turn: Turn
    forms: list[_Form]
    tokens: int


class _HeldRuns:
    """The runs of `CompiledPrompt.held` as a prompt is built, each joined to the one before
    when it goes on from it in the prompt and in the conversation alike."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []

    def add(self, index: int, number: int, length: int) -> None:
        if length <= 0:
            return
        runs = self.runs
        if runs:
            last_index, last_number, last_length = runs[-1]
            if last_index + last_length == index and last_number + last_length == number:
                runs[-1] = (last_index, last_number, last_length + length)
                return
        runs.append((index, number, length))


def _rank(memories: Sequence[str | ContextMemory]) -> list[ContextMemory]:
    items = [m if isinstance(m, ContextMemory) else ContextMemory(text=m) for m in memories]
    order = {id(item): position for position, item in enumerate(items)}
    return sorted(
        items,
        key=lambda m: (m.score is None, -(m.score or 0.0), order[id(m)]),
    )


def _rules_text(rules: str | Sequence[str]) -> str:
    if isinstance(rules, str):
        return f"{RULES_HEADING}\n{rules.strip()}" if rules.strip() else ""
    lines = [rule.strip() for rule in rules if rule.strip()]
    if not lines:
        return ""
    return RULES_HEADING + "\n" + "\n".join(f"- {line}" for line in lines)


class ContextEngine:
    """Compiles prompts that always fit: budgets, window, summary, pruning and degradation.

    Args:
        model: a model spec (``"gpt-4o"``), a `ChatTokenCounter` or a ``ChatModel``;
            counts are exact for it.
        budget: how the window is shared out (default: whole window, 12% answer reserve).
        pruning: how older tool output is cut.
        summary: when the oldest turns are folded into the running summary.
        summarizer: who writes the summary; default [`ExtractiveSummarizer`][] (offline).
        memory_sink: where evicted turns and committed summaries go (long-term memory).

    ``compile`` is synchronous, pure CPU and never calls a model: its cost depends on the
    newest messages and on what it has to cut, not on the window's or the conversation's
    length.
    """

    def __init__(
        self,
        model: str | ChatTokenCounter | ChatModel = "gpt-4o",
        *,
        budget: ContextBudget | None = None,
        pruning: PruningPolicy | None = None,
        summary: SummaryPolicy | None = None,
        summarizer: Summarizer | None = None,
        memory_sink: MemorySink | None = None,
    ) -> None:
        if isinstance(model, str):
            counter = counter_for(model)
        elif isinstance(model, ChatModel):
            counter = model.counter
        else:
            counter = model
        self.counter = counter
        self.budget_config = budget or ContextBudget()
        self.budget: ResolvedBudget = self.budget_config.resolve(counter.profile)
        self.pruning = pruning or PruningPolicy()
        self.summary_policy = summary or SummaryPolicy()
        self.summarizer: Summarizer = summarizer or ExtractiveSummarizer()
        self.memory_sink = memory_sink
        empty = Message.system("")
        self._priming = counter.count_messages([empty]) - counter.count_message(empty)
        self._blocks: dict[str, tuple[Message, int, int]] = {}
        self._last_summary: tuple[str, tuple[Message | None, int, int]] | None = None
        self._line_tokens: dict[str, int] = {}

    @property
    def model(self) -> str:
        """The model name counts are for."""
        return self.counter.profile.name

    @property
    def reply_priming_tokens(self) -> int:
        """Tokens the chat format adds to every prompt to prime the answer."""
        return self._priming

    def conversation(
        self,
        session_id: str = "default",
        messages: Sequence[Message] = (),
        *,
        summary: str = "",
        turns_summarized: int = 0,
    ) -> Conversation:
        """A new, incremental conversation bound to this engine's counter and policies.

        To resume a stored session, pass the raw ``messages`` it still held and its running
        ``summary`` (both read from [`Conversation`][] when it was saved); each message
        is counted once here, then never again.
        """
        conversation = Conversation(
            session_id,
            self.counter,
            pruning=self.pruning,
            summary_policy=self.summary_policy,
            summarizer=self.summarizer,
            summary_cap=self.budget.summary_cap,
            turns_budget=self.budget.limit - self.budget.summary_cap,
            memory_sink=self.memory_sink,
        )
        if summary:
            conversation._restore_summary(summary, turns_summarized)
        conversation.extend(messages)
        return conversation

    # --- cached counting -----------------------------------------------------------------

    def _block(self, text: str, *, by_lines: bool = False) -> tuple[Message, int, int]:
        """A system message with ``text``, its tokens and its content tokens (cached);
        ``by_lines``: its lines recur in other blocks, counted once each (exact all the same)."""
        cached = self._blocks.get(text)
        if cached is None:
            if len(self._blocks) >= _BLOCK_CACHE_SIZE:
                self._blocks.clear()
            message = Message.system(text)
            if self.counter.profile.chat_format == "chatml":
                tokens = self.counter.count_message(message)
                content = self.counter.count_text(text)
            else:
                # The text tokenized once: OpenAI's framing adds to it (a new summary, every
                # turn, would be tokenized twice).
                tokens, content = self.counter.count_message_content(message, by_lines=by_lines)
            cached = (message, tokens, content)
            self._blocks[text] = cached
        return cached

    def _line(self, text: str) -> int:
        tokens = self._line_tokens.get(text)
        if tokens is None:
            if len(self._line_tokens) >= _BLOCK_CACHE_SIZE * 8:
                self._line_tokens.clear()
            # A memory recalled again in another block shares most of its lines with it.
            tokens = self.counter.count_lines(f"- {text}\n")
            self._line_tokens[text] = tokens
        return tokens

    def _memories_block(self, kept: Sequence[ContextMemory]) -> tuple[Message | None, int, int]:
        if not kept:
            return None, 0, 0
        # Consecutive turns recall mostly the same memories: the block's lines were counted.
        text = MEMORIES_HEADING + "\n" + "\n".join(f"- {m.text.strip()}" for m in kept)
        return self._block(text, by_lines=True)

    def _summary_block(self, summary: str) -> tuple[Message | None, int, int]:
        # The session's summary is one object from one rewrite to the next (tens of kB late in
        # a session): stripping, joining and hashing it again at every compile cost its length.
        last = self._last_summary
        if last is not None and last[0] is summary:
            return last[1]
        block: tuple[Message | None, int, int] = (None, 0, 0)
        if summary.strip():
            # By lines: the summary's lines were counted when it was written.
            block = self._block(f"{SUMMARY_HEADING}\n{summary}", by_lines=True)
        self._last_summary = (summary, block)
        return block

    # --- compiling -----------------------------------------------------------------------

    def compile(
        self,
        history: Conversation | Sequence[Message],
        *,
        system: str,
        rules: str | Sequence[str] = (),
        memories: Sequence[str | ContextMemory] = (),
        tools: Sequence[ToolSchema] = (),
        extra_headroom: int = 0,
    ) -> CompiledPrompt:
        """Compile the prompt for the next model call.

        Args:
            history: the conversation (incremental), or a plain message list (counted now;
                fine for one-off prompts, not for a long-running session).
            system: the system prompt, sent verbatim as message 0.
            rules: operating rules (output format, banned tools, the current step's
                instructions): one text or one item per rule.
            memories: retrieved memories, ranked by score or by their order.
            tools: tool schemas in the OpenAI format, counted as the model sees them.
            extra_headroom: tokens to leave free beyond the answer reserve, e.g. to retry
                once with a smaller prompt after a provider answered that it was too long
                (its tokenizer disagreeing with the catalogue).

        Raises:
            ContextOverflowError: the system prompt, rules, tool schemas and the newest user
                message in its minimal form cannot fit the limit together, or the system
                prompt or rules exceed a cap set for them.
        """
        if isinstance(history, Conversation):
            if history.counter is not self.counter:
                raise UsageError(
                    "this conversation was counted for another model; create it with "
                    "this engine's conversation()"
                )
            conversation = history
        else:
            conversation = self.conversation("adhoc", history)
        compilation = _Compilation(self, conversation, system, rules, memories, tuple(tools))
        return compilation.run(extra_headroom)


class _Compilation:
    """The state of one compile: fixed sections, the planned window, the report's notes."""

    def __init__(
        self,
        engine: ContextEngine,
        conversation: Conversation,
        system: str,
        rules: str | Sequence[str],
        memories: Sequence[str | ContextMemory],
        tools: tuple[ToolSchema, ...],
    ) -> None:
        self.engine = engine
        self.conv = conversation
        self.budget = engine.budget
        self.tools = tools
        self.system_msg, self.system_t, _ = engine._block(system)
        rules_text = _rules_text(rules)
        self.rules_msg: Message | None = None
        self.rules_t = 0
        if rules_text:
            self.rules_msg, self.rules_t, _ = engine._block(rules_text)
        self.tools_t = engine.counter.count_tools(tools) if tools else 0
        self.memories = _rank(memories) if memories else []
        self.dropped: list[DroppedItem] = []
        self.steps: list[DegradationStep] = []
        self.older_turns = range(0)
        """The run of turns sent as held, pruned, before those in ``plan``."""

    def _check_caps(self) -> None:
        budget = self.budget
        if budget.system_cap is not None and self.system_t > budget.system_cap:
            raise ContextOverflowError(
                "the system prompt exceeds its cap",
                sections={"system": self.system_t},
                limit=budget.system_cap,
            )
        if budget.rules_cap is not None and self.rules_t > budget.rules_cap:
            raise ContextOverflowError(
                "the operating rules exceed their cap",
                sections={"rules": self.rules_t},
                limit=budget.rules_cap,
            )

    def _fit_memories(self) -> None:
        cap = self.budget.memories_cap
        engine = self.engine
        kept: list[ContextMemory] = []
        used = engine._line(MEMORIES_HEADING)
        for memory in self.memories:
            size = engine._line(memory.text.strip())
            if used + size > cap:
                break
            kept.append(memory)
            used += size
        message, tokens, content = engine._memories_block(kept)
        while kept and content > cap:
            kept.pop()
            message, tokens, content = engine._memories_block(kept)
        left_out = self.memories[len(kept) :]
        if left_out:
            self.dropped.append(
                DroppedItem(
                    section="memories",
                    count=len(left_out),
                    tokens=sum(engine._line(m.text.strip()) for m in left_out),
                    reason=f"over the memories cap of {cap} tokens (lowest-ranked first)",
                )
            )
        self.kept_memories = kept
        self.memories_msg, self.memories_t = message, tokens

    def _fit_summary(self) -> None:
        conv = self.conv
        engine = self.engine
        self.summary_msg, self.summary_t, _ = engine._summary_block(conv.summary)
        self.summary_cut: PrunedOutput | None = None
        cap = self.budget.summary_cap
        if self.summary_msg is not None and conv.summary_tokens > cap:
            shorter, shorter_t = cut_middle(
                engine.counter.tokenizer,
                conv.summary,
                cap,
                original_tokens=conv.summary_tokens,
                kind="elide",
            )
            self.summary_msg, self.summary_t, _ = engine._summary_block(shorter)
            self.summary_cut = PrunedOutput(
                message_index=-1,
                role="system",
                tool_call_id=None,
                original_tokens=conv.summary_tokens,
                kept_tokens=shorter_t,
                how="elided",
                original=conv.summary,
            )

    def _plan_window(self) -> None:
        """Greedy, newest first: the floor and current turn always, then what fits."""
        conv = self.conv
        turns = conv._turns
        n = len(turns)
        keep_recent = self.engine.pruning.keep_recent_messages
        newest_user = conv.newest_user_index()
        self.newest_user = newest_user
        floor_start = max(0, n - self.engine.summary_policy.keep_turns)
        must_start = floor_start if newest_user is None else min(floor_start, newest_user)
        self.must_start = must_start
        room = self.limit - self.fixed - self.memories_t - self.summary_t
        share_cap = int(room * self.engine.pruning.recent_share)
        plan: list[_Entry] = []
        used = 0
        position = 0  # history messages newer than the current one
        self.left_open = False
        for index in range(n - 1, -1, -1):
            turn = turns[index]
            if turn.pending:
                self.left_open = True
                position += len(turn.raw)
                continue
            if position >= keep_recent and index < must_start:
                # Every older turn goes as held, pruned, until one does not fit: that run is
                # found by one binary search, never walked.
                history = conv._pruned_history
                self.older_turns = range(history.fit_start(index + 1, room - used), index + 1)
                used += history.pruned_tokens_of(self.older_turns)
                break
            size = len(turn.raw)
            if position >= keep_recent:
                forms, tokens = turn.forms, turn.pruned_total
            elif position + size <= keep_recent:
                forms, tokens = turn.raw, turn.raw_total
            else:
                split = size - (keep_recent - position)
                forms = turn.forms[:split] + turn.raw[split:]
                tokens = sum(form.tokens for form in forms)
            if position < keep_recent:
                forms, tokens = self._cap_recent_tools(turn, forms, tokens, share_cap)
            if index < must_start and used + tokens > room:
                # A turn still in the recent zone may fit with its tool output pruned, as it
                # would be a few messages later; only a turn that cannot fit even so ends it.
                if tokens > turn.pruned_total and used + turn.pruned_total <= room:
                    forms, tokens = turn.forms, turn.pruned_total
                else:
                    break
            plan.append(_Entry(index, turn, list(forms), tokens))
            used += tokens
            position += size
        plan.reverse()
        self.plan = plan
        self.turns_t = used

    def _cap_recent_tools(
        self, turn: Turn, forms: list[_Form], tokens: int, cap: int
    ) -> tuple[list[_Form], int]:
        """Recent tool results larger than their share of the turns budget, cut to it."""
        if turn.raw_total <= cap or not turn.raw[0].message.tool_calls:
            return forms, tokens
        capped = list(forms)
        for position, form in enumerate(forms):
            if form.message.role == "tool" and form.tokens > cap:
                framing = form.tokens - form.content_tokens
                target = max(self.engine.pruning.max_tokens, cap - framing)
                if target > _QUANTUM * 8:
                    target -= target % _QUANTUM
                capped[position] = turn.cut_form(self.conv, position, target, "pruned")
        return capped, sum(form.tokens for form in capped)

    @property
    def total(self) -> int:
        return self.fixed + self.memories_t + self.summary_t + self.turns_t

    def _step(self, name: DegradationName, before: int, detail: str) -> None:
        saved = before - self.total
        if saved > 0:
            self.steps.append(DegradationStep(step=name, tokens_saved=saved, detail=detail))

    def _elide(self, entry: _Entry, position: int, target: int) -> int:
        """Elide message ``position`` of ``entry`` to ``target`` content tokens; tokens saved."""
        current = entry.forms[position]
        if target > _QUANTUM * 8:
            # Coarse targets let consecutive prompts reuse one cached elision of a big message.
            target -= target % _QUANTUM
        if target >= current.content_tokens:
            return 0
        form = entry.turn.cut_form(self.conv, position, target)
        if form.tokens >= current.tokens:
            return 0
        entry.forms[position] = form
        saved = current.tokens - form.tokens
        self.turns_t -= saved
        entry.tokens -= saved
        return saved

    def _elide_oversized(self) -> None:
        """Step 0: a message larger than the whole turns budget can never be sent whole."""
        room = self.limit - self.fixed - self.memories_t - self.summary_t
        oversized = [
            (entry, position)
            for entry in self.plan
            for position, form in enumerate(entry.forms)
            if form.tokens > room
        ]
        if not oversized:
            return
        others = self.turns_t - sum(entry.forms[position].tokens for entry, position in oversized)
        share = (room - others) // len(oversized)
        before = self.total
        for entry, position in oversized:
            framing = entry.turn.raw[position].tokens - entry.turn.raw[position].content_tokens
            target = max(self.engine.pruning.min_elided_tokens, share - framing)
            self._elide(entry, position, target)
        self._step(
            "elide_oversized",
            before,
            f"middle of {len(oversized)} message(s) larger than the turns budget ({room}) elided",
        )

    def _degrade(self) -> None:
        """Cut, in order, until the prompt fits: each step runs only while it is still over."""
        self._elide_oversized()
        self._prune_tools_harder()
        self._drop_memories()
        if self.total > self.limit and self.summary_msg is not None:
            self._shorten_summary(self.summary_msg)
        if self.total > self.limit:
            self._elide_messages()
        if self.total > self.limit:
            self._drop_below_floor()
        if self.total > self.limit:
            sections = {"system": self.system_t, "rules": self.rules_t, "tools": self.tools_t}
            if self.newest_user is not None:
                sections["newest_user_message"] = self.turns_t
            sections["reply_priming"] = self.engine._priming
            raise ContextOverflowError(
                "the system prompt, operating rules, tool schemas and newest user message "
                "(in its minimal form) do not fit the prompt limit together",
                sections=sections,
                limit=self.limit,
            )

    def _prune_tools_harder(self) -> None:
        """Step 1: prune tool output harder, oldest first, outside the current turn."""
        protected = self.newest_user if self.newest_user is not None else len(self.conv._turns)
        before, touched = self.total, 0
        for entry in self.plan:
            if self.total <= self.limit:
                break
            if entry.index >= protected:
                continue
            hard = entry.turn.hard_forms(self.conv)
            forms = [
                h if h.tokens < f.tokens else f for f, h in zip(entry.forms, hard, strict=True)
            ]
            tokens = sum(form.tokens for form in forms)
            if tokens < entry.tokens:
                self.turns_t -= entry.tokens - tokens
                entry.forms, entry.tokens = forms, tokens
                touched += 1
        self._step(
            "prune_tools_harder",
            before,
            f"tool results of {touched} turns cut to {self.engine.pruning.hard_max_tokens} tokens",
        )

    def _drop_memories(self) -> None:
        """Step 3: drop memories, lowest-ranked first."""
        before, dropped = self.total, 0
        while self.total > self.limit and self.kept_memories:
            self.kept_memories.pop()
            self.memories_msg, self.memories_t, _ = self.engine._memories_block(self.kept_memories)
            dropped += 1
        self._step("drop_memories", before, f"{dropped} lowest-ranked memories dropped")

    def _shorten_summary(self, summary: Message) -> None:
        """Step 4: cut the middle out of the summary, or drop it when too little would fit."""
        engine = self.engine
        before = self.total
        content_t = engine.counter.count_text(summary.content)
        target = content_t - (self.total - self.limit)
        if target < engine.pruning.min_elided_tokens:
            self.summary_msg, self.summary_t = None, 0
            detail = "summary dropped: too little of it would fit"
        else:
            shorter, _ = cut_middle(
                engine.counter.tokenizer,
                summary.content,
                target,
                original_tokens=content_t,
                kind="elide",
            )
            self.summary_msg, self.summary_t, _ = engine._block(shorter)
            detail = f"summary cut from {content_t} to {target} tokens"
        self._step("shorten_summary", before, detail)

    def _elide_messages(self) -> None:
        """Step 5: elide the middle of the largest messages."""
        before, count = self.total, 0
        floor = self.engine.pruning.min_elided_tokens
        progress = True
        while progress and self.total > self.limit:
            # Largest first; repeated passes because a marker can eat part of a cut.
            progress = False
            candidates = sorted(
                (
                    (entry.forms[position].content_tokens, entry, position)
                    for entry in self.plan
                    for position in range(len(entry.forms))
                ),
                key=lambda item: item[0],
                reverse=True,
            )
            for content_t, entry, position in candidates:
                over = self.total - self.limit
                if over <= 0 or content_t <= floor:
                    break
                if self._elide(entry, position, max(floor, content_t - over)):
                    count += 1
                    progress = True
        self._step("elide_messages", before, f"middle of {count} messages elided")

    def _drop_below_floor(self) -> None:
        """Step 6: below the floor, drop the oldest turns first, never the newest user message."""
        before, dropped = self.total, 0
        position = 0
        while self.total > self.limit and position < len(self.plan):
            entry = self.plan[position]
            if entry.index == self.newest_user:
                position += 1
                continue
            self.plan.pop(position)
            self.turns_t -= entry.tokens
            dropped += 1
        self._step("drop_below_floor", before, f"{dropped} turns dropped below the floor")

    def run(self, extra_headroom: int = 0) -> CompiledPrompt:
        engine = self.engine
        budget = self.budget
        self._check_caps()
        if extra_headroom < 0:
            raise UsageError("extra_headroom must not be negative")
        self.limit = budget.limit - extra_headroom
        self.fixed = self.system_t + self.rules_t + self.tools_t + engine._priming
        self._fit_memories()
        self._fit_summary()
        self.conv.turns_budget = max(
            1, self.limit - self.fixed - self.memories_t - budget.summary_cap
        )
        self._plan_window()
        if self.total > self.limit:
            # Only the floor can overflow: then no older turn fitted, the run of older turns
            # is empty, and degradation works on the planned entries alone.
            assert not self.older_turns
            self._degrade()
        return self._assemble()

    def _assemble(self) -> CompiledPrompt:
        messages: list[Message] = [self.system_msg]
        if self.memories_msg is not None:
            messages.append(self.memories_msg)
        if self.summary_msg is not None:
            messages.append(self.summary_msg)
        pruned: list[PrunedOutput] = []
        if self.summary_cut is not None and self.summary_msg is not None:
            pruned.append(self.summary_cut.model_copy(update={"message_index": len(messages) - 1}))
        messages, kept_raw, kept_messages, placeholders, held = self._place_turns(messages, pruned)
        self._mark_window_start()
        turns_kept = len(self.older_turns) + len(self.plan)
        outside = len(self.conv._turns) - turns_kept - (1 if self.left_open else 0)
        self._note_left_out(outside, kept_raw)
        report = self._report(
            turns_kept=turns_kept,
            messages_kept=kept_messages,
            turns_outside_window=max(0, outside),
            pruned=tuple(pruned),
        )
        sent = tuple(messages)
        # The prompt's count as built, for a model that counts what it is handed.
        engine = self.engine
        engine.counter.note_sum(sent, self.total - self.tools_t - engine._priming)
        return CompiledPrompt(
            messages=sent,
            tools=self.tools,
            report=report,
            placeholders=placeholders,
            held=held,
        )

    def _place_turns(
        self, blocks: list[Message], pruned: list[PrunedOutput]
    ) -> tuple[list[Message], int, int, frozenset[str], tuple[tuple[int, int, int], ...]]:
        """The prompt's messages: the fixed ``blocks`` so far, then the window's turns (the
        older run, then the planned entries, the rules just before the newest user message),
        their cuts added to ``pruned``; with the raw tokens and messages kept, the
        placeholders the whole prompt shows, and where the prompt shows the held messages
        themselves (`CompiledPrompt.held`)."""
        older = self.older_turns
        history = self.conv._pruned_history
        kept_raw = history.raw_tokens_of(older)
        # The fixed blocks are scanned (a few texts), the history never: its forms carry
        # their placeholders, and the older run's are kept by message number.
        shown = [message_placeholders(message) for message in blocks]
        shown.append(history.placeholders(older))
        older_start = len(blocks)
        # The older run's slice is the list the prompt is built in, the few blocks moved in
        # front of it: the window is copied once here, not once more into the blocks' list.
        messages = history.messages(older)
        kept_messages = len(messages)
        messages[:0] = blocks
        held = _HeldRuns()
        number = history.first_message(older.start) if older else 0
        after_cut = 0  # offset in the older run after the last cut message
        for offset, raw, form in history.cuts(older):
            pruned.append(self._pruned_output(older_start + offset, raw, form))
            held.add(older_start + after_cut, number + after_cut, offset - after_cut)
            after_cut = offset + 1
        held.add(older_start + after_cut, number + after_cut, kept_messages - after_cut)
        rules_placed = False
        for entry in self.plan:
            if entry.index == self.newest_user and self.rules_msg is not None:
                messages.append(self.rules_msg)
                rules_placed = True
            kept_raw += entry.turn.raw_total
            kept_messages += len(entry.forms)
            number = history.first_message(entry.index)
            for position, form in enumerate(entry.forms):
                if form.how is not None:
                    pruned.append(
                        self._pruned_output(len(messages), entry.turn.raw[position], form)
                    )
                else:
                    held.add(len(messages), number + position, 1)
                messages.append(form.message)
                if form.placeholders:
                    shown.append(form.placeholders)
        if self.rules_msg is not None:
            if not rules_placed:
                messages.append(self.rules_msg)
            shown.append(message_placeholders(self.rules_msg))
        return messages, kept_raw, kept_messages, frozenset().union(*shown), tuple(held.runs)

    def _mark_window_start(self) -> None:
        """Remember the oldest turn sent, where the next compile's window starts looking."""
        conv = self.conv
        if self.older_turns:
            conv._window_start_seq = conv._turns[self.older_turns.start].seq
        elif self.plan:
            conv._window_start_seq = self.plan[0].turn.seq
        elif conv._turns:
            conv._window_start_seq = conv._turns[-1].seq

    def _note_left_out(self, outside: int, kept_raw: int) -> None:
        """Report the turns not sent: those older than the window, and one left open."""
        conv = self.conv
        if outside > 0:
            self.dropped.append(
                DroppedItem(
                    section="turns",
                    count=outside,
                    tokens=conv.raw_tokens - kept_raw,
                    reason="older than the window; held raw until summarized",
                )
            )
        if self.left_open:
            self.dropped.append(
                DroppedItem(
                    section="turns",
                    count=1,
                    tokens=conv._turns[-1].raw_total,
                    reason="tool calls still waiting for their results",
                )
            )

    def _report(
        self,
        *,
        turns_kept: int,
        messages_kept: int,
        turns_outside_window: int,
        pruned: tuple[PrunedOutput, ...],
    ) -> BudgetReport:
        budget = self.budget
        engine = self.engine
        # model_construct: the values are built here, validation would only cost.
        return BudgetReport.model_construct(
            model=engine.model,
            exact=engine.counter.exact,
            window=budget.window,
            effective_window=budget.effective_window,
            reserve=budget.reserve,
            limit=self.limit,
            prompt_tokens=self.total,
            sections=SectionTokens.model_construct(
                system=self.system_t,
                memories=self.memories_t,
                summary=self.summary_t,
                turns=self.turns_t,
                rules=self.rules_t,
                tools=self.tools_t,
                reply_priming=engine._priming,
            ),
            memories_cap=budget.memories_cap,
            summary_cap=budget.summary_cap,
            turns_kept=turns_kept,
            messages_kept=messages_kept,
            turns_outside_window=turns_outside_window,
            turns_summarized=self.conv.turns_summarized,
            summary_pending=self.conv.needs_summary,
            pruned=pruned,
            dropped=tuple(self.dropped),
            degradations=tuple(self.steps),
        )

    @staticmethod
    def _pruned_output(message_index: int, raw: _Form, form: _Form) -> PrunedOutput:
        assert form.how is not None, "only cut forms are reported"
        # model_construct: the values are built here, validation would only cost.
        return PrunedOutput.model_construct(
            message_index=message_index,
            role=raw.message.role,
            tool_call_id=raw.message.tool_call_id,
            original_tokens=raw.content_tokens,
            kept_tokens=form.content_tokens,
            how=form.how,
            original=raw.message.content,
        )
