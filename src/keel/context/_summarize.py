"""Summarizers: fold evicted turns into the running summary.

The running summary keeps four kinds of lines: decisions made, facts shared, actions taken
(tool calls and what they returned) and pending items; pleasantries and repeats are dropped.
[`ExtractiveSummarizer`][] needs no model and is the default; [`ModelSummarizer`][]
asks a chat model with a prompt that preserves the same four kinds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from keel.context._text import cut_middle
from keel.errors import MalformedResponseError
from keel.messages import Message
from keel.models import ChatModel, ModelOptions
from keel.privacy import defang_placeholders, placeholders_in
from keel.tokens import ChatTokenCounter

__all__ = [
    "ExtractiveSummarizer",
    "ModelSummarizer",
    "Summarizer",
    "SummaryRequest",
    "summarizer_for",
]

SMALL_MODEL_WINDOW = 16_384
"""Models with a window up to this size summarize extractively by default (see summarizer_for)."""


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """One summarization job.

    Attributes:
        previous: the running summary so far ('' at first).
        messages: the evicted turns, oldest first, whole (a tool call with its results);
            empty when the job is to condense ``previous`` under ``max_tokens``.
        max_tokens: the summary's cap, in tokens of the target model.
        counter: counts tokens of the target model.
    """

    previous: str
    messages: Sequence[Message]
    max_tokens: int
    counter: ChatTokenCounter


@runtime_checkable
class Summarizer(Protocol):
    """Merges evicted turns into the running summary and returns the new summary.

    Raising (or running past the policy's timeout) commits nothing: the turns stay raw.
    A result over ``max_tokens`` is condensed once more, then cut with a marker.
    """

    async def summarize(self, request: SummaryRequest) -> str:
        """The new running summary."""
        ...


# --- extractive --------------------------------------------------------------------------

_SECTIONS = ("Decisions", "Facts", "Actions", "Pending")
# When the summary must shrink, sections give up their oldest lines in proportion to their
# size divided by these weights: decisions and pending items are kept longest.
_WEIGHTS = {"Decisions": 3.0, "Facts": 1.5, "Actions": 1.0, "Pending": 2.0}

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_PLEASANTRY = re.compile(
    r"^(hi|hello|hey|thanks?( you)?( so much| a lot)?|thank you( very much)?|ok(ay)?|great|"
    r"perfect|sure|cool|nice|got it|sounds good|no problem|you'?re welcome|bye|goodbye|"
    r"have a (nice|great|good) (day|one)|cheers|awesome|alright|yes|no|yep|nope|"
    r"good (morning|afternoon|evening)|glad to help|happy to help)\b[\s!.,]*\w*[\s!.,]*$",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(decided|decide|will|won't|going to|chose|choose|chosen|confirmed|confirm|booked|"
    r"agreed|scheduled|approved|selected|cancel(l)?ed|let's|we'll|i'll|opted|settled|"
    r"switch(ed)? to|instead)\b",
    re.IGNORECASE,
)
_PENDING = re.compile(
    r"\b(pending|waiting|todo|to do|follow up|follow-up|next step|still need|remaining|"
    r"not yet|later|tomorrow|remind|outstanding|open question|unresolved)\b",
    re.IGNORECASE,
)
_REQUEST = re.compile(
    r"\?$|^(please|can you|could you|would you|i need|i want|i'd like|i would like|help me)\b",
    re.IGNORECASE,
)
_FACT = re.compile(r"\d|\b(my|is|are|was|were|has|have|lives?|named?|called)\b", re.IGNORECASE)
_NORMALIZE = re.compile(r"[^a-z0-9]+")
_MAX_LINE_CHARS = 240
_MAX_SENTENCES_PER_MESSAGE = 8


def _normalize(line: str) -> str:
    return _NORMALIZE.sub(" ", line.lower()).strip()


def _clip(text: str, limit: int = _MAX_LINE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def parse_summary(text: str) -> dict[str, list[str]]:
    """Split a summary in the extractive format back into its sections' lines."""
    sections: dict[str, list[str]] = {name: [] for name in _SECTIONS}
    current = "Facts"
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        header = line.rstrip(":")
        if header in sections and line.endswith(":"):
            current = header
            continue
        sections[current].append(line[2:] if line.startswith("- ") else line)
    return sections


def render_summary(sections: dict[str, list[str]]) -> str:
    """The summary text: one header per non-empty section, one ``- `` line per item."""
    blocks = []
    for name in _SECTIONS:
        lines = sections.get(name) or []
        if lines:
            blocks.append(f"{name}:\n" + "\n".join(f"- {line}" for line in lines))
    return "\n".join(blocks)


class ExtractiveSummarizer:
    """Builds the summary from the turns' own sentences; no model, deterministic, fast.

    User statements carrying facts (numbers, names, "my ...") become facts; user requests and
    questions, and sentences about waiting or follow-ups, become pending items; assistant
    sentences that commit to something (booked, confirmed, will, decided) become decisions;
    each tool call becomes an action with the head of its result. Pleasantries and lines
    already in the summary are dropped. Over the cap, the oldest lines go first, from the
    sections with the most tokens relative to their weight (decisions and pending items last).
    """

    def __init__(self, *, max_line_chars: int = _MAX_LINE_CHARS) -> None:
        self.max_line_chars = max_line_chars
        # Lines survive from one summary to the next: count each one once.
        self._line_tokens: dict[tuple[str, str], int] = {}
        # The last summary written, parsed, with its lines' keys: the next request's
        # ``previous`` is almost always that text, and reading it again (split, normalize
        # every line) would cost the whole summary's length at every fold.
        self._last: tuple[str, dict[str, list[str]], dict[str, int]] | None = None

    async def summarize(self, request: SummaryRequest) -> str:
        """The merged summary, within ``request.max_tokens``."""
        return self.summarize_sync(request)

    def summarize_sync(self, request: SummaryRequest) -> str:
        """Synchronous form of [`summarize`][] (the work is pure CPU)."""
        sections, seen = self._parsed(request.previous)
        results = {m.tool_call_id: m for m in request.messages if m.role == "tool"}

        def add(section: str, line: str) -> None:
            line = _clip(line, self.max_line_chars)
            key = _normalize(line)
            if len(key) < 3 or key in seen:
                return
            seen[key] = 1
            sections[section].append(line)

        for message in request.messages:
            if message.role == "tool":
                continue
            for call in message.tool_calls:
                result = results.get(call.id)
                outcome = ""
                if result is not None:
                    # Only the head of a result is read: outputs can be megabytes.
                    head = result.content[:400].strip().split("\n", 1)[0]
                    outcome = " -> " + _clip(head, 120)
                add("Actions", f"{call.name}({_clip(call.arguments, 100)}){outcome}")
            text = message.content[: _MAX_SENTENCES_PER_MESSAGE * _MAX_LINE_CHARS]
            sentences = [s.strip() for s in _SENTENCE.split(text) if s.strip()]
            for sentence in sentences[:_MAX_SENTENCES_PER_MESSAGE]:
                if _PLEASANTRY.match(sentence) or len(sentence) < 4:
                    continue
                if message.role == "user":
                    if _PENDING.search(sentence) or _REQUEST.search(sentence):
                        add("Pending", f"User asked: {sentence}")
                    elif _FACT.search(sentence):
                        # Not "User: ...": a summary line then spells a whole stored turn
                        # record ("User: <message>"), which reads as a memory stored twice.
                        add("Facts", f"User said: {sentence}")
                elif message.role == "assistant":
                    if _PENDING.search(sentence):
                        add("Pending", sentence)
                    elif _DECISION.search(sentence):
                        add("Decisions", sentence)
                    elif _FACT.search(sentence):
                        add("Facts", sentence)
                elif message.role == "system":
                    add("Facts", f"Note: {sentence}")
        text = self._fit(sections, request.counter, request.max_tokens, seen)
        self._last = (text, sections, seen)
        return text

    def _parsed(self, previous: str) -> tuple[dict[str, list[str]], dict[str, int]]:
        """``previous``'s sections and their lines' keys (how many lines have each), copies
        the caller may change: those of the last summary written when ``previous`` is that
        text (parsing a rendered summary gives its sections back: each line is one clipped
        line), else parsed."""
        last = self._last
        if last is not None and (last[0] is previous or last[0] == previous):
            return {name: list(lines) for name, lines in last[1].items()}, dict(last[2])
        sections = parse_summary(previous)
        seen: dict[str, int] = {}
        for lines in sections.values():
            for line in lines:
                key = _normalize(line)
                seen[key] = seen.get(key, 0) + 1
        return sections, seen

    def _count_line(self, counter: ChatTokenCounter, line: str) -> int:
        key = (counter.profile.encoding, line)
        tokens = self._line_tokens.get(key)
        if tokens is None:
            if len(self._line_tokens) >= 8192:
                self._line_tokens.clear()
            tokens = counter.count_text(f"- {line}\n")
            self._line_tokens[key] = tokens
        return tokens

    def _fit(
        self,
        sections: dict[str, list[str]],
        counter: ChatTokenCounter,
        cap: int,
        seen: dict[str, int] | None = None,
    ) -> str:
        """The sections rendered within ``cap`` tokens, oldest lines dropped first (from
        ``sections``, and their keys from ``seen``). Counted by lines: exact, and a summary
        that repeats the last one's lines tokenizes only its new ones."""
        text = render_summary(sections)
        if counter.count_lines(text) <= cap:
            return text
        sizes = {
            name: [self._count_line(counter, line) for line in lines]
            for name, lines in sections.items()
        }
        totals = {name: sum(values) for name, values in sizes.items()}
        headers = sum(counter.count_text(f"{name}:\n") for name in _SECTIONS)
        while sum(totals.values()) + headers > cap and any(sections.values()):
            name = max((n for n in _SECTIONS if sections[n]), key=lambda n: totals[n] / _WEIGHTS[n])
            _forget(seen, sections[name].pop(0))
            totals[name] -= sizes[name].pop(0)
        text = render_summary(sections)
        while text and counter.count_lines(text) > cap:
            # The per-line estimate can be off by a token or two at the seams.
            name = max((n for n in _SECTIONS if sections[n]), key=lambda n: totals[n])
            _forget(seen, sections[name].pop(0))
            totals[name] -= sizes[name].pop(0)
            text = render_summary(sections)
        return text


def _forget(seen: dict[str, int] | None, line: str) -> None:
    if seen is None:
        return
    key = _normalize(line)
    left = seen.get(key, 0) - 1
    if left > 0:
        seen[key] = left
    else:
        seen.pop(key, None)


# --- model -------------------------------------------------------------------------------

SUMMARY_INSTRUCTIONS = """\
You maintain the running summary of a conversation between a user and an AI assistant.
Merge the new conversation excerpt into the existing summary. Keep, as short bullet lines:
- Decisions: what was decided, chosen, booked, confirmed or cancelled, with exact values.
- Facts: facts the user shared (names, numbers, ids, dates, preferences, constraints).
- Actions: tool calls made and what they returned that matters.
- Pending: open questions, requests not yet done, follow-ups promised.
Copy names, numbers, ids and dates exactly. Drop greetings, thanks, small talk and anything
already in the summary. Never invent anything. Answer with the summary only, in this form:
Decisions:
- ...
Facts:
- ...
Actions:
- ...
Pending:
- ...
Stay under {max_tokens} tokens."""

CONDENSE_INSTRUCTIONS = """\
Condense this conversation summary to under {max_tokens} tokens. Keep every decision and
pending item, exact names, numbers, ids and dates; merge or drop the least important facts
and actions first. Keep the same four sections (Decisions, Facts, Actions, Pending).
Answer with the summary only."""


class ModelSummarizer:
    """Summarizes with a chat model, using a prompt that keeps decisions, facts, actions, pending.

    Long tool outputs are cut to ``tool_output_tokens`` in the transcript. When the transcript
    does not fit the summarizing model's window, it is folded in chunks (each chunk merged into
    the summary of the previous ones). Errors of the model propagate, so the conversation keeps
    the raw turns.

    Args:
        model: the chat model that writes summaries (a small, cheap one is fine).
        options: generation options; ``max_tokens`` defaults to the summary cap and
            temperature to 0.
        tool_output_tokens: how much of each tool result the model sees.
    """

    def __init__(
        self,
        model: ChatModel,
        *,
        options: ModelOptions | None = None,
        tool_output_tokens: int = 200,
    ) -> None:
        self.model = model
        self.options = options
        self.tool_output_tokens = tool_output_tokens

    def _line(self, message: Message) -> str:
        tokenizer = self.model.counter.tokenizer
        if message.role == "tool":
            content = message.content
            size = tokenizer.count(content)
            if size > self.tool_output_tokens:
                content, _ = cut_middle(
                    tokenizer, content, self.tool_output_tokens, original_tokens=size
                )
            return f"[tool result {message.name or message.tool_call_id}] {content}"
        parts = [f"[{message.role}] {message.content}".rstrip()]
        parts.extend(
            f"[{message.role} called {call.name}({call.arguments})]" for call in message.tool_calls
        )
        return "\n".join(parts)

    async def _ask(self, instructions: str, body: str, max_tokens: int) -> str:
        base = self.options or ModelOptions()
        options = base.model_copy(
            update={
                "max_tokens": base.max_tokens or max_tokens,
                "temperature": 0.0 if base.temperature is None else base.temperature,
            }
        )
        completion = await self.model.acomplete(
            [Message.system(instructions), Message.user(body)], options=options
        )
        text = completion.message.content.strip()
        if not text:
            raise MalformedResponseError(
                "the summarizing model returned an empty summary", model=self.model.spec
            )
        return text

    async def summarize(self, request: SummaryRequest) -> str:
        """The merged summary (may exceed the cap; the conversation then condenses it)."""
        cap = request.max_tokens
        # A summary may hold the placeholders it was given, no other: a model that turns a
        # defanged one (text a tool wrote) back into a placeholder would make it look keel's.
        given = set(placeholders_in(request.previous))
        if not request.messages:
            condensed = await self._ask(
                CONDENSE_INSTRUCTIONS.format(max_tokens=cap), request.previous, cap
            )
            return defang_placeholders(condensed, keep=given)
        instructions = SUMMARY_INSTRUCTIONS.format(max_tokens=cap)
        counter = self.model.counter
        window = self.model.profile.context_window
        room = max(
            512,
            int(window * 0.9)
            - cap
            - counter.count_text(instructions)
            - counter.count_text(request.previous)
            - 64,
        )
        chunks: list[list[str]] = [[]]
        used = 0
        for message in request.messages:
            line = self._line(message)
            size = counter.count_text(line) + 1
            if chunks[-1] and used + size > room:
                chunks.append([])
                used = 0
            chunks[-1].append(line)
            given.update(placeholders_in(line))
            used += size
        summary = request.previous
        for chunk in chunks:
            body = (
                f"Existing summary:\n{summary or '(none yet)'}\n\n"
                "New conversation excerpt:\n" + "\n".join(chunk)
            )
            summary = await self._ask(instructions, body, cap)
        return defang_placeholders(summary, keep=given)


def summarizer_for(model: ChatModel | None) -> Summarizer:
    """The default summarizer for an agent whose configured model is ``model``.

    Extractive (no model call) when there is no model, or when it is a small local model
    (the bundled SmolLM2, or any window of at most ``SMALL_MODEL_WINDOW`` tokens): such a
    model's summaries lose more than they keep, and the call would compete with the agent's
    own turns for the one local model. Otherwise a [`ModelSummarizer`][] on that model.
    """
    if model is None:
        return ExtractiveSummarizer()
    if model.spec.startswith("local:") or model.profile.context_window <= SMALL_MODEL_WINDOW:
        return ExtractiveSummarizer()
    return ModelSummarizer(model)
