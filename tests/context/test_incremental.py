"""Differential test: the incremental compile gives exactly what walking every turn gives.

``ReferenceCompilation`` is the compile as it was before the older turns of the window became
one run (one binary search and one slice): every turn of the window is walked and planned as
an entry. Random conversations, budgets and policies, compiled again and again as messages
are added and the oldest turns summarized, must give the same prompt both ways. Their texts
spell placeholders (at the start, in the middle that pruning cuts, in tool calls' arguments):
the placeholders a compiled prompt says it shows, kept as the history grew, must be exactly
those its messages show, scanned whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from keel.context import (
    CompiledPrompt,
    ContextBudget,
    ContextEngine,
    ContextMemory,
    Conversation,
    PruningPolicy,
    SummaryPolicy,
    SummaryRequest,
)
from keel.context._conversation import _Form, _PrunedHistory
from keel.context._engine import _Compilation, _Entry
from keel.context._report import BudgetReport, DroppedItem, PrunedOutput, SectionTokens
from keel.errors import ContextOverflowError
from keel.messages import Message, ToolCall
from keel.privacy import message_placeholders, placeholders_in
from tests.context._helpers import TOOLS, text_of


class ReferenceCompilation(_Compilation):
    """The compile walking every turn of the window (the algorithm before the older run)."""

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

    def _assemble(self) -> CompiledPrompt:
        conv = self.conv
        messages: list[Message] = [self.system_msg]
        if self.memories_msg is not None:
            messages.append(self.memories_msg)
        if self.summary_msg is not None:
            messages.append(self.summary_msg)
        pruned: list[PrunedOutput] = []
        if self.summary_cut is not None and self.summary_msg is not None:
            pruned.append(self.summary_cut.model_copy(update={"message_index": len(messages) - 1}))
        rules_placed = False
        kept_raw = 0
        kept_messages = 0
        for entry in self.plan:
            if entry.index == self.newest_user and self.rules_msg is not None:
                messages.append(self.rules_msg)
                rules_placed = True
            kept_raw += entry.turn.raw_total
            kept_messages += len(entry.forms)
            for position, form in enumerate(entry.forms):
                if form.how is not None:
                    raw = entry.turn.raw[position]
                    # model_construct: the values are built here, validation would only cost.
                    pruned.append(
                        PrunedOutput.model_construct(
                            message_index=len(messages),
                            role=raw.message.role,
                            tool_call_id=raw.message.tool_call_id,
                            original_tokens=raw.content_tokens,
                            kept_tokens=form.content_tokens,
                            how=form.how,
                            original=raw.message.content,
                        )
                    )
                messages.append(form.message)
        if self.rules_msg is not None and not rules_placed:
            messages.append(self.rules_msg)
        if self.plan:
            conv._window_start_seq = self.plan[0].turn.seq
        elif conv._turns:
            conv._window_start_seq = conv._turns[-1].seq
        outside = len(conv._turns) - len(self.plan) - (1 if self.left_open else 0)
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
        budget = self.budget
        engine = self.engine
        report = BudgetReport.model_construct(
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
            turns_kept=len(self.plan),
            messages_kept=kept_messages,
            turns_outside_window=max(0, outside),
            turns_summarized=conv.turns_summarized,
            summary_pending=conv.needs_summary,
            pruned=tuple(pruned),
            dropped=tuple(self.dropped),
            degradations=tuple(self.steps),
        )
        return CompiledPrompt(messages=tuple(messages), tools=self.tools, report=report)


def held_runs(
    prompt: CompiledPrompt, conversation: Conversation
) -> tuple[tuple[int, int, int], ...]:
    """`CompiledPrompt.held` found from scratch: every message of the prompt that is one the
    conversation holds (the very object), by its number, in maximal runs."""
    first = conversation.messages_summarized
    numbers = {id(message): first + k for k, message in enumerate(conversation.messages)}
    runs: list[tuple[int, int, int]] = []
    for index, message in enumerate(prompt.messages):
        number = numbers.get(id(message))
        if number is None:
            continue
        if runs and runs[-1][0] + runs[-1][2] == index and runs[-1][1] + runs[-1][2] == number:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, number, 1))
    return tuple(runs)


class ScriptedSummarizer:
    """Summaries of scripted sizes, some over the summary cap (condensed again on commit)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.calls = 0

    async def summarize(self, request: SummaryRequest) -> str:
        size = self.sizes[self.calls % len(self.sizes)]
        self.calls += 1
        return f"summary {self.calls} of {len(request.messages)} messages: " + text_of(size, size)


@dataclass
class AddTurn:
    kind: str  # user, answer, notice, tools
    sizes: list[int]
    answered: int = 0  # tools: results added now; the others wait for the next action


@dataclass
class Chat:
    turns: int  # small turns in a row: user questions, lookups and answers, for long runs


@dataclass
class Compile:
    rules: int
    memories: int
    tools: bool
    headroom: int


@dataclass
class Summarize:
    force: bool


tool_sizes = st.one_of(st.integers(0, 120), st.integers(120, 900), st.integers(900, 4_000))
user_sizes = st.one_of(st.integers(0, 300), st.integers(300, 3_000))
add_turns = st.one_of(
    st.builds(AddTurn, st.just("user"), st.lists(user_sizes, min_size=1, max_size=1)),
    st.builds(AddTurn, st.just("answer"), st.lists(st.integers(0, 300), min_size=1, max_size=1)),
    st.builds(AddTurn, st.just("notice"), st.lists(st.integers(1, 60), min_size=1, max_size=1)),
    st.builds(
        AddTurn,
        st.just("tools"),
        st.lists(tool_sizes, min_size=1, max_size=3),
        st.integers(0, 3),
    ),
)
actions = st.one_of(
    add_turns,
    add_turns,
    add_turns,
    st.builds(Chat, st.integers(4, 40)),
    st.builds(
        Compile,
        rules=st.integers(0, 3),
        memories=st.integers(0, 4),
        tools=st.booleans(),
        headroom=st.sampled_from([0, 0, 0, 300]),
    ),
    st.builds(Summarize, force=st.sampled_from([False, False, False, True])),
)


class Session:
    """A conversation driven by actions, compiled both ways at every ``Compile``."""

    def __init__(self, engine: ContextEngine, seed: int) -> None:
        self.engine = engine
        self.conversation = engine.conversation("diff")
        self.seed = seed
        self.number = 0
        self.waiting: list[Message] = []  # results of the open turn not added yet

    def add(self, action: AddTurn) -> None:
        self.conversation.extend(self.waiting)
        self.waiting = []
        self.number += 1
        tag = f"t{self.number}"
        seed = self.seed + self.number
        size = action.sizes[0]
        # Some texts spell placeholders, one in the middle a cut may take out.
        mark = f" <EMAIL_{self.number}> " if seed % 3 == 0 else " "
        if action.kind == "user":
            self.conversation.add(Message.user(f"{tag}{mark}" + text_of(size, seed)))
        elif action.kind == "answer":
            self.conversation.add(Message.assistant(f"{tag} " + text_of(size, seed)))
        elif action.kind == "notice":
            self.conversation.add(Message.system(f"{tag} note " + text_of(size, seed)))
        else:
            calls = [
                ToolCall(id=f"{tag}_{i}", name="lookup", arguments=f'{{"query": "{tag}{mark}"}}')
                for i in range(len(action.sizes))
            ]
            self.conversation.add(Message.assistant("", tool_calls=calls))
            results = [
                Message.tool(
                    call.id,
                    text_of(size // 2, seed + size)
                    + f"{mark}<PHONE_{self.number}> "
                    + text_of(size - size // 2, seed),
                    name="lookup",
                )
                for call, size in zip(calls, action.sizes, strict=True)
            ]
            self.conversation.extend(results[: action.answered])
            self.waiting = results[action.answered :]

    def chat(self, action: Chat) -> None:
        kinds = ["user", "tools", "answer"]
        for number in range(action.turns):
            size = (self.seed + number) % 60
            self.add(AddTurn(kinds[number % 3], [size], answered=1))

    def compile_both(self, action: Compile) -> None:
        system = "You are a careful assistant. " + text_of(30, self.seed)
        rules = [f"Rule {i}: " + text_of(10 + 20 * i, i) for i in range(action.rules)]
        memories = [
            ContextMemory(text=f"memory {i} " + text_of(40 * (i + 1), i), score=1 / (i + 1))
            for i in range(action.memories)
        ]
        tools = TOOLS if action.tools else []
        conversation = self.conversation
        try:
            expected: CompiledPrompt | ContextOverflowError = ReferenceCompilation(
                self.engine, conversation, system, rules, memories, tuple(tools)
            ).run(action.headroom)
        except ContextOverflowError as exc:
            expected = exc
        expected_start = conversation._window_start_seq
        compilation = _Compilation(self.engine, conversation, system, rules, memories, tuple(tools))
        try:
            actual: CompiledPrompt | ContextOverflowError = compilation.run(action.headroom)
        except ContextOverflowError as exc:
            actual = exc
        if isinstance(expected, ContextOverflowError):
            assert isinstance(actual, ContextOverflowError)
            assert (actual.sections, actual.limit) == (expected.sections, expected.limit)
            event("overflow error")
            return
        assert isinstance(actual, CompiledPrompt)
        assert actual.messages == expected.messages
        assert actual.tools == expected.tools
        assert actual.report == expected.report
        assert conversation._window_start_seq == expected_start
        scanned = frozenset().union(*map(message_placeholders, actual.messages))
        assert actual.placeholders == scanned
        assert actual.held == held_runs(actual, conversation)
        if len(actual.held) > 1:
            event("the prompt shows held messages in more than one run")
        if scanned:
            event("placeholders shown")
        if any(set(placeholders_in(cut.original)) - scanned for cut in actual.report.pruned):
            event("a cut took a placeholder out of the prompt")
        report = actual.report
        event("degraded" if report.degradations else "not degraded")
        if self.waiting:
            event("tool calls waiting for their results")
        older = compilation.older_turns
        if len(older) > 10:
            event("more than 10 older turns in one run")
        if conversation._pruned_history.cuts(older):
            event("cut tool output in the run of older turns")
        if older and older.start > 0:
            event("the run of older turns ends on one that does not fit")


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    window=st.one_of(st.integers(1_000, 4_000), st.integers(4_000, 40_000)),
    reserve_ratio=st.floats(0.05, 0.3),
    keep_recent=st.integers(0, 8),
    max_tokens=st.sampled_from([16, 40, 100, 400]),
    hard_max_tokens=st.sampled_from([16, 30, 96]),
    keep_turns=st.integers(1, 4),
    summary_sizes=st.lists(st.integers(0, 3_000), min_size=1, max_size=3),
    steps=st.lists(actions, min_size=10, max_size=120),
    seed=st.integers(0, 1_000),
)
def test_incremental_compile_equals_walking_every_turn(
    window: int,
    reserve_ratio: float,
    keep_recent: int,
    max_tokens: int,
    hard_max_tokens: int,
    keep_turns: int,
    summary_sizes: list[int],
    steps: list[AddTurn | Chat | Compile | Summarize],
    seed: int,
) -> None:
    engine = ContextEngine(
        "gpt-4o",
        budget=ContextBudget(window=window, reserve_ratio=reserve_ratio),
        pruning=PruningPolicy(
            keep_recent_messages=keep_recent,
            max_tokens=max_tokens,
            hard_max_tokens=min(hard_max_tokens, max_tokens),
        ),
        summary=SummaryPolicy(keep_turns=keep_turns),
        summarizer=ScriptedSummarizer(summary_sizes),
    )
    session = Session(engine, seed)
    for step in [*steps, Compile(rules=1, memories=1, tools=True, headroom=0)]:
        if isinstance(step, AddTurn):
            session.add(step)
        elif isinstance(step, Chat):
            session.chat(step)
        elif isinstance(step, Compile):
            session.compile_both(step)
        else:
            outcome = session.conversation.summarize(force=step.force)
            if outcome is not None and outcome.committed:
                event("summarized")
                check_pruned_history(session.conversation)
    check_pruned_history(session.conversation)


def check_pruned_history(conversation: Conversation) -> None:
    """The flattened history holds exactly the held turns' pruned forms, nothing evicted."""
    history = conversation._pruned_history
    held = range(len(conversation.turns))
    forms = [form for turn in conversation.turns for form in turn.forms]
    assert history.messages(held) == [form.message for form in forms]
    cut = [(offset, form) for offset, form in enumerate(forms) if form.how is not None]
    assert [(offset, form) for offset, _, form in history.cuts(held)] == cut
    assert len(history._cut_at) == len(history._cuts) == len(cut)
    marked = [form.placeholders for form in forms if form.placeholders]
    assert history._marks == marked and len(history._marked_at) == len(marked)
    assert history.placeholders(held) == frozenset().union(*marked)
    assert history.pruned_tokens_of(held) == conversation.pruned_tokens


@given(
    sizes=st.lists(st.integers(1, 50), max_size=30),
    stop_share=st.floats(0, 1),
    slack=st.integers(-2, 2),
    room_share=st.floats(0, 1),
)
def test_fit_start_is_the_first_turn_the_newest_first_walk_cannot_take(
    sizes: list[int], stop_share: float, slack: int, room_share: float
) -> None:
    history = _PrunedHistory()
    for size in sizes:
        history.open_turn()
        form = _Form(Message.user("x"), size, size, None)
        history.append(form, form)
    stop = round(len(sizes) * stop_share)
    # Rooms at and next to the exact sum of a run: the boundary a binary search gets wrong.
    room = sum(sizes[round(stop * room_share) : stop]) + slack
    used, start = 0, stop
    while start > 0 and used + sizes[start - 1] <= room:
        start -= 1
        used += sizes[start]
    assert history.fit_start(stop, room) == start
    assert history.pruned_tokens_of(range(start, stop)) == used
