"""One session's message log: what every checkpoint stores and what the context engine reads.

A turn's messages exist in one place. The loop works on its own copy of the log (the history
it hands to the model hook and returns at the end); `SessionLog.take` masks what the loop
added since the last call, once, and appends it to the log and to the context engine's
[`Conversation`][] of it together. A checkpoint stores [`messages`][].

A log belongs to one state version of its session: the one its owner last wrote or read. A turn
that ends by rewriting history (a revert to the last good state, corrections dropped from the
committed turn) or by an error drops the log, and the next turn builds it again from the store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from keel.context import ContextEngine, Conversation
from keel.messages import Message
from keel.state import AgentState

__all__ = ["SessionLog", "SessionLogs"]


class SessionLog:
    """The masked messages of one session, with the context engine's conversation of them."""

    def __init__(
        self,
        conversation: Conversation,
        messages: Sequence[Message],
        *,
        version: int,
        summarized_before: int,
    ) -> None:
        self.conversation = conversation
        self._messages = list(messages)
        self.version = version
        """The state version the log is the messages of."""
        self._summarized_before = summarized_before

    @classmethod
    def of(cls, engine: ContextEngine, key: str, state: AgentState, version: int) -> SessionLog:
        """The log of ``state`` (version ``version`` of session ``key``), its summary restored."""
        runtime = state.runtime
        summarized = runtime.messages_summarized
        conversation = engine.conversation(
            key,
            state.messages[summarized:],
            summary=runtime.summary,
            turns_summarized=runtime.turns_summarized,
        )
        return cls(conversation, state.messages, version=version, summarized_before=summarized)

    def catch_up(self, state: AgentState, version: int) -> bool:
        """Bring the log to ``version`` when its ``state`` (written by another process) only
        added messages after the log's and summarized nothing more; whether it did (if not,
        the caller builds the log again). Only the added messages are counted: the log's own
        are compared, not counted again."""
        runtime = state.runtime
        held = len(self._messages)
        conversation = self.conversation
        if (
            version <= self.version
            or len(state.messages) < held
            or runtime.messages_summarized != self.messages_summarized
            or runtime.turns_summarized != conversation.turns_summarized
            or runtime.summary != conversation.summary
            or state.messages[:held] != self._messages
        ):
            return False
        self._extend(state.messages[held:])
        self.version = version
        return True

    def __len__(self) -> int:
        return len(self._messages)

    @property
    def conversation_start(self) -> int:
        """The position in the log of the conversation's first message (its message number
        0): the log holds every message the conversation was given, in order, after those
        summarized before it was built."""
        return self._summarized_before

    @property
    def messages(self) -> list[Message]:
        """The log, as a list of the caller's own (what a checkpoint stores)."""
        return list(self._messages)

    @property
    def live(self) -> list[Message]:
        """The log itself, not copied: it only ever grows at its end. Read it; never change it."""
        return self._messages

    def since(self, start: int) -> list[Message]:
        """The log's messages from position ``start`` on (costs what they are, not the log)."""
        return self._messages[start:]

    def append(self, message: Message) -> None:
        """Add one message, already masked."""
        self._messages.append(message)
        self.conversation.add(message)

    def take(self, history: Sequence[Message], mask: Callable[[Message], Message]) -> None:
        """Mask and add the messages of ``history`` past the log's end (the loop's history
        starts as the log, so positions agree)."""
        self._extend([mask(message) for message in history[len(self._messages) :]])

    async def atake(
        self, history: Sequence[Message], mask: Callable[[Message], Awaitable[Message]]
    ) -> None:
        """`take` with an async ``mask`` (one that writes to the vault off the loop)."""
        self._extend([await mask(message) for message in history[len(self._messages) :]])

    def take_added(
        self, added: Sequence[Message], start: int, mask: Callable[[Message], Message]
    ) -> None:
        """Mask and add what a loop that started from the log's first ``start`` messages added
        (``added``, in order) and the log does not hold yet."""
        self._extend([mask(message) for message in added[len(self._messages) - start :]])

    async def atake_added(
        self,
        added: Sequence[Message],
        start: int,
        mask: Callable[[Message], Awaitable[Message]],
    ) -> None:
        """`take_added` with an async ``mask``."""
        self._extend([await mask(message) for message in added[len(self._messages) - start :]])

    def _extend(self, masked: list[Message]) -> None:
        self._messages.extend(masked)
        self.conversation.extend(masked)

    @property
    def messages_summarized(self) -> int:
        """Leading messages of the log folded into the running summary."""
        return self._summarized_before + self.conversation.messages_summarized


class SessionLogs(OrderedDict[str, SessionLog]):
    """The sessions' logs one agent keeps, by session key, over its context engine: the
    ``size`` most recently used (an evicted session's log is rebuilt from the store)."""

    def __init__(self, engine: ContextEngine, size: int) -> None:
        super().__init__()
        self.engine = engine
        self.size = size

    def __setitem__(self, key: str, value: SessionLog) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)

    def of(self, key: str, state: AgentState, version: int) -> SessionLog:
        """The session's log at ``version``: the kept one (brought up to ``version`` when
        another process only added to it), or built from ``state``."""
        cached = self.get(key)
        if cached is not None and (cached.version == version or cached.catch_up(state, version)):
            self.move_to_end(key)
            return cached
        log = SessionLog.of(self.engine, key, state, version)
        self[key] = log
        return log
