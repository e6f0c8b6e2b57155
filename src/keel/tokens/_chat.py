"""Counting whole prompts: message framing and tool schemas, not only text.

A chat message costs more than its text. OpenAI's chat format frames each message as
``<|start|>role<|message|>content<|end|>`` (3 tokens beyond the text, 1 more for a name) and
primes the reply with 3 tokens. ChatML models (SmolLM2) frame each message as
``<|im_start|>role\\n content<|im_end|>\\n``; for those the framing is tokenized exactly.
Tool schemas are counted in the TypeScript-like form OpenAI renders them in.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from keel.messages import Message, equal_run_length
from keel.tokens._base import Tokenizer
from keel.tokens._catalog import ModelProfile

__all__ = ["ChatTokenCounter", "render_tools_for_counting"]

_OPENAI_PER_MESSAGE = 3
_OPENAI_PER_NAME = 1
_OPENAI_REPLY_PRIMING = 3
_OPENAI_PER_TOOL_CALL = 6  # id, type and function framing of one call in an assistant turn
_OPENAI_TOOLS_FRAMING = 12  # the system-side wrapper announcing the functions namespace
_TOOLS_CACHE_SIZE = 64
_LAST_LISTS = 8
"""Lists whose running sums are kept (a turn counts its conversation and its prompt)."""

_CHATML_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _json_type(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items", {})
        return f"{_json_type(items) if isinstance(items, Mapping) else 'any'}[]"
    if kind == "object":
        return "object"
    if kind in ("integer", "number"):
        return "number"
    if isinstance(kind, list):
        return " | ".join(str(part) for part in kind)
    if "anyOf" in schema:
        return " | ".join(_json_type(part) for part in schema["anyOf"])
    return str(kind or "any")


_RESYNC = 3
"""How far ahead in the earlier list a message is looked for (blocks left out of a prompt)."""
_TAIL = 8
"""Messages added at the end that the guess of where a shifted window resumes allows for."""


_LINE_STARTS = frozenset("[-")
"""Besides letters and digits, what may follow a newline where a text is cut for counting."""


def newline_pieces(text: str) -> list[str]:
    """``text`` cut after each newline that a letter, a digit, ``[`` or ``-`` follows (each
    piece keeps its newlines): where a tokenizer with ``splits_after_newlines`` starts a new
    pre-token anyway."""
    pieces: list[str] = []
    start = 0
    end = len(text)
    found = text.find("\n")
    while found != -1:
        after = found + 1
        if after < end and ((char := text[after]).isalnum() or char in _LINE_STARTS):
            pieces.append(text[start:after])
            start = after
        found = text.find("\n", after)
    pieces.append(text[start:])
    return pieces


def render_tools_for_counting(tools: Sequence[Mapping[str, Any]]) -> str:
    """Tools in OpenAI's ``tools`` format rendered as the model reads them."""
    lines = ["namespace functions {", ""]
    for tool in tools:
        function = tool.get("function", tool)
        description = function.get("description")
        if description:
            lines.append(f"// {description}")
        parameters = function.get("parameters") or {}
        properties: Mapping[str, Any] = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        if properties:
            lines.append(f"type {function['name']} = (_: {{")
            for field, schema in properties.items():
                if isinstance(schema, Mapping) and schema.get("description"):
                    lines.append(f"// {schema['description']}")
                optional = "" if field in required else "?"
                field_type = _json_type(schema) if isinstance(schema, Mapping) else "any"
                lines.append(f"{field}{optional}: {field_type},")
            lines.append("}) => any;")
        else:
            lines.append(f"type {function['name']} = () => any;")
        lines.append("")
    lines.append("} // namespace functions")
    return "\n".join(lines)


# Texts longer than this are not cached, and at most _CACHED_TEXTS are: the cache holds at most
# 32 MB of text in the worst case, typically well under one (memories are short).
_CACHED_TEXT_CHARS = 4096
_CACHED_TEXTS = 8192


class ChatTokenCounter:
    """Counts prompts for one model: text, per-message framing, tool calls and tool schemas."""

    def __init__(
        self, profile: ModelProfile, tokenizer: Tokenizer, *, cache_size: int = 65_536
    ) -> None:
        self.profile = profile
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        # A message's count is a pure function of its role, text, name and tool calls: keep
        # the counts of recent messages, so a prompt that repeats the window (every compile,
        # every usage report) costs a dict look-up per message, not a tokenization.
        # Each bounded cache here is an OrderedDict: its oldest entry goes in one step, where a
        # plain dict's is found past every slot its earlier drops emptied (a full cache paid
        # for a walk of thousands of empty slots a drop).
        self._message_counts: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        # The same message objects are counted on every compile: by identity first, which
        # costs one dict look-up instead of building the content key, and lets a whole list
        # be summed at C speed. The objects are kept alive with their entries, so an id
        # cannot be reused while its entry lives.
        self._identity_counts: OrderedDict[int, int] = OrderedDict()
        self._identity_kept: dict[int, Message] = {}
        self._tools_counts: dict[str, int] = {}
        # Short texts counted again and again (the same memories packed on every turn; a
        # message's content, tool names and arguments, counted as the model's reply and again
        # as the conversation takes in its masked copy): their counts, by text. Long texts are
        # tokenized each time rather than kept alive here.
        self._text_counts: OrderedDict[str, int] = OrderedDict()
        # The totals of the last lists counted, by their first message's identity (that
        # message kept alive in the list, so its id is not reused): a prompt and the
        # conversation it was compiled from are counted in turn, and each continues its own.
        self._last_lists: OrderedDict[int, tuple[tuple[Message, ...], int]] = OrderedDict()
        # The summed counts of tuples noted by whoever built and counted them (`note_sum`),
        # by the tuple's identity (kept alive with its entry, so its id is not reused).
        self._known_sums: OrderedDict[int, tuple[tuple[Message, ...], int]] = OrderedDict()

    @property
    def exact(self) -> bool:
        """Whether counts are exact (False for estimated models)."""
        return self.tokenizer.exact and self.profile.exact

    def count_text(self, text: str) -> int:
        """Tokens of plain text (cached for texts up to ``_CACHED_TEXT_CHARS`` characters)."""
        if len(text) > _CACHED_TEXT_CHARS or self.cache_size <= 0:
            return self.tokenizer.count(text)
        tokens = self._text_counts.get(text)
        if tokens is None:
            tokens = self.tokenizer.count(text)
            self._keep_count(text, tokens)
        return tokens

    def _keep_count(self, text: str, tokens: int) -> None:
        if len(self._text_counts) >= min(self.cache_size, _CACHED_TEXTS):
            # Oldest first, as the message counts; another thread may evict it first.
            with contextlib.suppress(KeyError):
                self._text_counts.popitem(last=False)
        self._text_counts[text] = tokens

    def count_lines(self, text: str) -> int:
        """[`count_text`][] of a text that repeats lines counted before (memories recalled
        again, in other blocks and orders): exactly, as the sum of its lines' cached counts
        where the tokenizer starts a new pre-token after a newline anyway
        (``splits_after_newlines``), so only its new lines are tokenized; else whole."""
        if (
            self.cache_size <= 0
            or not getattr(self.tokenizer, "splits_after_newlines", False)
            or "\n" not in text
        ):
            return self.count_text(text)
        known = self._text_counts.get(text)
        if known is not None:
            return known
        tokens = sum(self.count_text(piece) for piece in newline_pieces(text))
        if len(text) <= _CACHED_TEXT_CHARS:
            # A block shown again whole (the same hit and neighbours): one look-up next time.
            self._keep_count(text, tokens)
        return tokens

    def _chatml_render(self, message: Message) -> str:
        body = message.content
        if message.tool_calls:
            calls = [
                {"name": call.name, "arguments": call.arguments, "id": call.id}
                for call in message.tool_calls
            ]
            body = (body + "\n" if body else "") + json.dumps(calls, ensure_ascii=False)
        return f"<|im_start|>{message.role}\n{body}<|im_end|>\n"

    def count_message(self, message: Message) -> int:
        """Tokens one message costs in a prompt, framing included (cached per message)."""
        known = self._identity_counts.get(id(message))
        if known is not None:
            return known
        return self._remember(message, self._count_by_content(message))

    def count_message_content(self, message: Message, *, by_lines: bool = False) -> tuple[int, int]:
        """[`count_message`][] of ``message``, and the tokens of its content within that (what
        cutting its content can save): the content is tokenized once, not once more for a
        copy without it, where the framing adds to the content (OpenAI's chat format).
        ``by_lines``: the content is counted with [`count_lines`][] (it repeats lines)."""
        if not message.content:
            return self.count_message(message), 0
        if self.profile.chat_format == "chatml":
            tokens = self.count_message(message)
            framing = self.count_message(message.model_copy(update={"content": ""}))
            return tokens, max(0, tokens - framing)
        content = (self.count_lines if by_lines else self.count_text)(message.content)
        known = self._identity_counts.get(id(message))
        if known is None:
            known = self._remember(message, self._count_openai(message, content))
        return known, content

    def _remember(self, message: Message, tokens: int) -> int:
        """Keep ``tokens`` as ``message``'s count (by identity, the object kept alive)."""
        if self.cache_size > 0:
            if len(self._identity_counts) >= self.cache_size:
                oldest, _ = self._identity_counts.popitem(last=False)
                del self._identity_kept[oldest]
            self._identity_counts[id(message)] = tokens
            self._identity_kept[id(message)] = message
        return tokens

    def _count_by_content(self, message: Message) -> int:
        key = (
            message.role,
            message.content,
            message.name,
            tuple((call.id, call.name, call.arguments) for call in message.tool_calls),
        )
        cached = self._message_counts.get(key)
        if cached is not None:
            return cached
        tokens = self._count_message(message)
        if self.cache_size > 0:
            if len(self._message_counts) >= self.cache_size:
                # Oldest first.
                with contextlib.suppress(KeyError):
                    self._message_counts.popitem(last=False)
            self._message_counts[key] = tokens
        return tokens

    def _count_message(self, message: Message) -> int:
        if self.profile.chat_format == "chatml":
            encode_template = getattr(self.tokenizer, "encode_template", None)
            rendered = self._chatml_render(message)
            if encode_template is not None:
                return len(encode_template(rendered))
            framing = self.tokenizer.count(f"<|im_start|>{message.role}\n") + 3
            return framing + self.tokenizer.count(rendered)
        return self._count_openai(message, self.count_text(message.content))

    def _count_openai(self, message: Message, content_tokens: int) -> int:
        """A message's tokens in OpenAI's chat format, its content's already counted."""
        tokens = _OPENAI_PER_MESSAGE + content_tokens
        if message.name:
            tokens += _OPENAI_PER_NAME + self.count_text(message.name)
        for call in message.tool_calls:
            tokens += _OPENAI_PER_TOOL_CALL + self.count_text(call.name)
            tokens += self.count_text(call.arguments)
        return tokens

    def count_messages(self, messages: Iterable[Message], *, prime_reply: bool = True) -> int:
        """Tokens of a whole message list, including the reply priming."""
        # Kept (see `_count_list`) as a tuple, which cannot change under the next count: a
        # tuple given (a compiled prompt's) is not copied.
        message_list = messages if type(messages) is tuple else tuple(messages)
        known = self._known_sums.get(id(message_list))
        if known is not None and known[0] is message_list:
            total = known[1]
            self._keep_list(message_list, total)  # where the next list's count starts
        else:
            total = self._count_list(message_list)
        if self.profile.chat_format == "chatml":
            if not message_list or message_list[0].role != "system":
                total += self.count_message(Message.system(_CHATML_DEFAULT_SYSTEM))
            if prime_reply:
                total += self._chatml_priming()
            return total
        return total + (_OPENAI_REPLY_PRIMING if prime_reply else 0)

    def _count_list(self, messages: tuple[Message, ...]) -> int:
        """The summed counts of ``messages``, from the previous list where they agree.

        Successive prompts of a session repeat the one before with a few messages changed:
        some added at the end, a block near the start replaced (the memories of this turn,
        a new summary), one moved (the rules, after the newest user message), the oldest
        turns left out. The total of the last list counted is kept with it; runs of the same
        objects in both are found by identity and compared as lists in C, and only the
        messages outside them are looked up: a prompt costs what changed in it, not a look-up
        per message of its window.
        """
        # Taken, not shared (``dict.pop`` is atomic): a thread counting at the same moment
        # starts afresh instead of from them.
        first = id(messages[0]) if messages else 0
        previous = self._last_lists.pop(first, None)
        if previous is None:
            earlier: tuple[Message, ...] = ()
            total = 0
        else:
            earlier, total = previous
        i = j = 0
        size, before = len(messages), len(earlier)
        where: dict[int, int] | None = None  # earlier's positions, made on a second miss
        missed = False
        while i < size and j < before:
            message = messages[i]
            ahead = next(
                (k for k in range(j, min(j + _RESYNC, before)) if earlier[k] is message), None
            )
            if ahead is None and missed:
                # Two misses in a row: turns left out of this prompt, most likely (the oldest,
                # summarized, or a window that slides). If the rest is the end of the earlier
                # list with a few messages added, this one sits as far from that end; failing
                # that, where each message was is looked up from now on.
                end = before - (size - i)
                ahead = next(
                    (
                        k
                        for k in range(max(j, end), min(end + _TAIL, before))
                        if earlier[k] is message
                    ),
                    None,
                )
                if ahead is None:
                    if where is None:
                        where = dict(zip(map(id, earlier), range(before), strict=True))
                    found = where.get(id(message), -1)
                    ahead = found if found >= j and earlier[found] is message else None
            if ahead is None:
                total += self.count_message(message)  # new here (or moved)
                missed = True
                i += 1
                continue
            total -= sum(map(self.count_message, earlier[j:ahead]))  # left out of this one
            run = equal_run_length(
                messages, i, earlier, ahead, min(len(earlier) - ahead, len(messages) - i)
            )
            i, j, missed = i + run, ahead + run, False
        total += sum(map(self.count_message, messages[i:]))  # added at the end
        total -= sum(map(self.count_message, earlier[j:]))
        self._keep_list(messages, total)
        return total

    def _keep_list(self, messages: tuple[Message, ...], total: int) -> None:
        """Keep ``messages`` and their summed counts for the next list with the same first."""
        if messages:
            if len(self._last_lists) >= _LAST_LISTS:
                # Oldest first; another thread may evict it first.
                with contextlib.suppress(KeyError):
                    self._last_lists.popitem(last=False)
            self._last_lists[id(messages[0])] = (messages, total)

    def note_sum(self, messages: tuple[Message, ...], tokens: int) -> None:
        """Keep ``tokens`` as the summed counts of ``messages`` (a tuple, which cannot change)
        for a count of that very tuple. The context engine notes each prompt it compiles, as
        counted while it built it (exact: [`CompiledPrompt.tokens`][keel.context.CompiledPrompt]):
        a model that reports usage by counting the prompt it is handed (a scripted one, a
        provider that sent no usage, a failed call's trace) then costs a look-up, not a pass
        over the window. A copy of the prompt, or another counter, counts it message by
        message."""
        if self.cache_size <= 0 or not messages:
            return
        known = self._known_sums
        if len(known) >= _LAST_LISTS:
            # Oldest first; another thread may evict it first.
            with contextlib.suppress(KeyError):
                known.popitem(last=False)
        known[id(messages)] = (messages, tokens)

    def _chatml_priming(self) -> int:
        encode_template = getattr(self.tokenizer, "encode_template", None)
        if encode_template is not None:
            return len(encode_template("<|im_start|>assistant\n"))
        return self.tokenizer.count("assistant\n") + 1

    def count_tools(self, tools: Sequence[Mapping[str, Any]]) -> int:
        """Tokens the tool schemas add to a prompt (0 for none)."""
        if not tools:
            return 0
        # Keyed by the rendering, which is what is counted: an agent sends the same schemas
        # on every call (fresh copies), and tokenizing them costs more than rendering.
        rendered = render_tools_for_counting(tools)
        tokens = self._tools_counts.get(rendered)
        if tokens is None:
            tokens = self.tokenizer.count(rendered) + _OPENAI_TOOLS_FRAMING
            if self.cache_size > 0:
                if len(self._tools_counts) >= _TOOLS_CACHE_SIZE:
                    self._tools_counts.clear()
                self._tools_counts[rendered] = tokens
        return tokens

    def count_prompt(
        self, messages: Iterable[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> int:
        """Tokens of a complete request: messages, framing, reply priming and tools."""
        return self.count_messages(messages) + self.count_tools(tools)
