"""An OpenAI Agents SDK ``Session`` on keel's state store and context engine.

The SDK's own sessions return stored items as they are: cut with ``limit``, a
``function_call_output`` can be sent without its ``function_call`` (openai-agents-python#4322),
and nothing keeps the history inside the model's window. ``KeelSession.get_items`` returns the
history the model should see: within an exact token budget (the answer's reserve kept free),
older turns folded into one running summary (written by keel's extractive summarizer or by a
model of your choice), old tool output pruned, a call never separated from its output (with or
without ``limit``, which returns at most that many items, the summary among them). Items are
PII-masked before they are stored, and every write is compare-and-set on the session's version,
so a failed or concurrent write never leaves half a turn (#4615). State lives where keel's state
lives: a SQLite file, PostgreSQL or Redis, durable across processes.

With a PII vault (``vault=``), each value is stored sealed in the vault and the items hold the
user's stable placeholder for it (two addresses are ``<EMAIL_1>`` and ``<EMAIL_2>`` in every
item and turn); ``get_items`` and ``pop_item`` give the user's values back, so the next run's
model and tools see them as the SDK's own sessions would have given them.

    from keel.integrations.openai_agents import KeelSession
    session = KeelSession("user-42", database="sqlite:///agents.db", model="gpt-4o")
    await Runner.run(agent, "Hi", session=session)
    session.close()
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

try:
    import agents  # noqa: F401  (the SDK this session is for)
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    from keel.errors import BackendUnavailableError

    raise BackendUnavailableError(
        "the OpenAI Agents SDK is not installed (the 'openai-agents' extra)"
    ) from exc

from pydantic import BaseModel, Field

from keel._bridge import run_blocking
from keel.context import (
    ContextBudget,
    ContextEngine,
    ModelSummarizer,
    PruningPolicy,
    Summarizer,
    SummaryPolicy,
)
from keel.errors import ConflictError, StateError
from keel.integrations._privacy import PrivateHistory
from keel.messages import Message, ToolCall
from keel.models import ChatModel
from keel.privacy import PIIMasker, PrivacyView, Vault
from keel.state import StateStore

__all__ = ["SUMMARY_MARK", "KeelSession", "SessionItems"]

SUMMARY_MARK = "[keel summary of the earlier conversation]\n"
"""How the summary item's text starts."""

_MASKED_KEYS = frozenset({"content", "text", "output", "arguments"})
_WRITTEN_BY_THE_MODEL = frozenset({"function_call", "custom_tool_call", "reasoning"})
"""The kinds of item without a role whose text the model wrote; any other (a tool's output,
a hosted tool's call with its results) holds what a tool returned."""


class SessionItems(BaseModel):
    """What a session stores: its items as JSON texts (immutable, so a write validates and
    stores only the new ones), the running summary, and how many items it covers."""

    items: list[str] = Field(default_factory=list)
    summary: str = ""
    summarized: int = 0
    owner: str = ""
    """The user whose vault numbered the placeholders in ``items`` ("": stored without one)."""


def _texts_changed(value: Any, change: Callable[[str], str], key: str | None = None) -> Any:
    """``value`` with ``change`` applied to the text of its content fields (ids, names, types
    kept): masking before a write, revealing after a read."""
    if isinstance(value, dict):
        return {k: _texts_changed(v, change, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_texts_changed(v, change, key) for v in value]
    if isinstance(value, str) and key in _MASKED_KEYS:
        return change(value)
    return value


def _masked_item(item: dict[str, Any], view: PrivacyView) -> dict[str, Any]:
    """``item`` as stored: masked, and what a tool returned in it defanged first
    ([`mask_tool_output`][keel.privacy.PrivacyView.mask_tool_output]); a call's arguments are the
    model's."""
    if "role" in item or item.get("type") in _WRITTEN_BY_THE_MODEL:
        written: dict[str, Any] = _texts_changed(item, view.mask)
        return written
    masked: dict[str, Any] = _texts_changed(item, view.mask_tool_output)
    if "arguments" in item:
        masked["arguments"] = _texts_changed(item["arguments"], view.mask, "arguments")
    return masked


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return "" if content is None else str(content)


def _to_keel(items: Sequence[dict[str, Any]], offset: int) -> list[Message]:
    """The items as keel messages, each tagged with the item indexes it came from; items the
    engine has no role for (reasoning, built-in tool calls) travel with the next message."""
    messages: list[Message] = []
    carried: list[int] = []
    for position, item in enumerate(items, start=offset):
        kind = item.get("type")
        role = item.get("role")
        origin = [*carried, position]
        if kind == "function_call":
            call = ToolCall(
                id=str(item["call_id"]),
                name=str(item.get("name", "tool")),
                arguments=str(item.get("arguments", "{}")),
            )
            previous = messages[-1] if messages else None
            if previous is not None and previous.role == "assistant" and previous.tool_calls:
                # Calls of one response are one assistant message: their outputs follow it.
                messages[-1] = previous.model_copy(
                    update={
                        "tool_calls": (*previous.tool_calls, call),
                        "metadata": {"items": [*previous.metadata["items"], *origin]},
                    }
                )
            else:
                messages.append(
                    Message.assistant("", tool_calls=[call], metadata={"items": origin})
                )
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            messages.append(Message.tool(str(item["call_id"]), text, metadata={"items": origin}))
        elif role in ("user", "system", "developer"):
            make = Message.user if role == "user" else Message.system
            messages.append(make(_text(item.get("content")), metadata={"items": origin}))
        elif role == "assistant":
            messages.append(
                Message.assistant(_text(item.get("content")), metadata={"items": origin})
            )
        else:
            carried = origin
            continue
        carried = []
    return messages


class KeelSession(PrivateHistory[SessionItems]):
    """A Session (the Agents SDK protocol) whose history fits the model's window.

    Args:
        session_id: the conversation's id.
        database: where state lives (``sqlite:///PATH``, ``postgresql://...``, ``redis://...``);
            or pass ``state``.
        state: a state store of [`SessionItems`][] (several sessions can share one).
        model: the model whose tokenizer and window count.
        budget, pruning, summary: the context engine's policies.
        summarizer: who writes the running summary: a ``ChatModel`` (through
            [`keel.context.ModelSummarizer`][]), any [`keel.context.Summarizer`][], or
            None for keel's extractive one (offline, no model call).
        masker: masks PII before anything is stored (None: keel's default policy).
        tenant: whose policy masks, and whose vault holds the values.
        user_id: whose values the session holds (None: the session id names the user).
        vault: the PII vault: values are stored there sealed, items hold the user's stable
            placeholders, and reads give the user their values back. Not given, and
            ``database`` a SQL URL: the vault ``Backends.open`` opens on that database
            (``KEEL_PII_KEY`` / ``KEEL_PII_KEY_FILE``; neither set, on SQLite keel's own key
            file in the config directory). Without a vault (``KEEL_PII_VAULT=off``, a
            PostgreSQL database given no key, Redis), the items of one ``add_items``
            call are numbered together (two addresses in it are ``<EMAIL_1>`` and
            ``<EMAIL_2>``), and reads give placeholders.

    ``close()`` (or ``async with``) releases the database the session opened from
    ``database``; a ``state`` store passed in is the caller's to close.

    Raises:
        VaultKeyError: the PII key is malformed or not the vault's, or a PostgreSQL database
            holds a vault and no key is given.
    """

    session_settings = None

    def __init__(
        self,
        session_id: str,
        *,
        database: str | None = None,
        state: StateStore[SessionItems] | None = None,
        model: str = "gpt-4o",
        budget: ContextBudget | None = None,
        pruning: PruningPolicy | None = None,
        summary: SummaryPolicy | None = None,
        summarizer: Summarizer | ChatModel | None = None,
        masker: PIIMasker | None = None,
        tenant: str = "default",
        user_id: str | None = None,
        vault: Vault | None = None,
    ) -> None:
        super().__init__(
            SessionItems,
            session_id,
            database=database,
            state=state,
            masker=masker,
            tenant=tenant,
            user_id=user_id,
            vault=vault,
        )
        self.session_id = session_id
        if isinstance(summarizer, ChatModel):
            summarizer = ModelSummarizer(summarizer)
        self.engine = ContextEngine(
            model, budget=budget, pruning=pruning, summary=summary, summarizer=summarizer
        )

    async def _load(self) -> SessionItems:
        found = await self.state.aget(self.session_id)
        return SessionItems() if found is None else found.state

    async def all_items(self) -> list[dict[str, Any]]:
        """Every stored item as stored (masked: placeholders, never values), oldest first,
        with none left out."""
        return [json.loads(item) for item in (await self._load()).items]

    async def add_items(self, items: list[Any]) -> None:
        """Append ``items`` (masked) in one compare-and-set write: all of them or none."""
        if not items:
            return
        found = await self.state.aget(self.session_id)
        owner = None if found is None else found.state.owner
        encoded = await run_blocking(self._encoded, items, owner)

        def append(current: SessionItems) -> dict[str, Any]:
            if current.owner != (self.new_owner if owner is None else owner):
                raise ConflictError(self.session_id, None, None)  # recreated meanwhile
            return {"items": [*current.items, *encoded]}

        try:
            await self.state.atransact(self.session_id, append)
        except StateError:  # a new session
            fresh = SessionItems(items=encoded, owner=self.new_owner)
            try:
                await self.state.acreate(self.session_id, fresh)
            except ConflictError:  # another writer created it meanwhile
                await self.state.atransact(self.session_id, append)

    def _encoded(self, items: list[Any], owner: str | None) -> list[str]:
        """The items as stored: masked, the placeholders of one write numbered together."""
        view = self._writing_view(owner, per_call=True)
        return [json.dumps(_masked_item(dict(i), view), ensure_ascii=False) for i in items]

    async def _revealed(self, items: list[dict[str, Any]], owner: str) -> list[dict[str, Any]]:
        """``items`` with the owner's values in them, when the owner reads."""
        view = self._reading_view(owner)
        if not view.reveals:
            return items
        return await run_blocking(lambda: [_texts_changed(i, view.reveal) for i in items])

    async def pop_item(self) -> dict[str, Any] | None:
        """Remove and return the newest item, the user's values in it (None when the session
        is empty)."""
        popped: list[str] = []

        def drop_last(current: SessionItems) -> dict[str, Any] | None:
            popped.clear()
            if not current.items:
                return None
            popped.extend((current.items[-1], current.owner))
            kept = current.items[:-1]
            return {"items": kept, "summarized": min(current.summarized, len(kept))}

        try:
            await self.state.atransact(self.session_id, drop_last)
        except StateError:  # no such session
            return None
        if not popped:
            return None
        return (await self._revealed([json.loads(popped[0])], popped[1]))[0]

    async def clear_session(self) -> None:
        """Forget the session."""
        await self.state.adelete(self.session_id)

    async def get_items(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The history as the model should see it: within the budget, the summary first,
        tool calls with their outputs. ``limit`` keeps at most that many of the newest
        items, the summary counted as the oldest: fewer where the cut would separate an
        output from its call (the output goes too)."""
        stored = await self.state.aget(self.session_id)
        if stored is None:
            return []
        current = stored.state
        # Only the items after the summary are decoded: a call's work does not grow with the
        # session's length once older turns are folded.
        start = current.summarized
        items = {start + i: json.loads(item) for i, item in enumerate(current.items[start:])}
        history = _to_keel(list(items.values()), start)
        if not history:
            return []
        conversation = self.engine.conversation(messages=history, summary=current.summary)
        if conversation.needs_summary and await conversation.asummarize() is not None:
            folded = conversation.messages_summarized
            covered = max(
                (i for m in history[:folded] for i in m.metadata["items"]),
                default=current.summarized - 1,
            )
            await self._keep_summary(stored.version, conversation.summary, covered + 1)
        result = self._fit(conversation, items, system="")
        if conversation.summary.strip():
            result.insert(0, {"role": "system", "content": SUMMARY_MARK + conversation.summary})
        newest = result if limit is None else _newest(result, limit)
        return await self._revealed(newest, current.owner)

    def _fit(
        self, conversation: Any, items: dict[int, dict[str, Any]], *, system: str
    ) -> list[dict[str, Any]]:
        """The items the compiled prompt keeps, in order; pruned outputs carry the cut text."""
        compiled = self.engine.compile(conversation, system=system)
        kept: dict[int, Message] = {}
        for message in compiled.messages:
            for index in message.metadata.get("items", ()):
                kept[index] = message
        result: list[dict[str, Any]] = []
        for index in sorted(kept):
            item = items[index]
            message = kept[index]
            if item.get("type") == "function_call_output" and message.metadata.get("keel_cut"):
                item = {**item, "output": message.content}
            result.append(item)
        return result

    def input_filter(self, data: Any) -> Any:
        """For ``RunConfig(call_model_input_filter=session.input_filter)``: every model call's
        whole input (the history and the turn in progress, whose tool outputs the session has
        not stored yet) fitted to the budget, the agent's instructions counted as the system
        prompt; the summary item is kept first."""
        from agents.run_config import ModelInputData

        model_data = data.model_data
        summary = ""
        items: dict[int, dict[str, Any]] = {}
        for index, item in enumerate(model_data.input):
            entry = dict(item)
            content = entry.get("content")
            if entry.get("role") == "system" and str(content or "").startswith(SUMMARY_MARK):
                summary = str(content)[len(SUMMARY_MARK) :]
                continue
            items[index] = entry
        history = _to_keel(list(items.values()), 0)
        # _to_keel numbers items from 0 in order; map those numbers back to input positions.
        positions = list(items)
        for message in history:
            message.metadata["items"] = [positions[i] for i in message.metadata["items"]]
        if not history:
            return model_data
        conversation = self.engine.conversation(messages=history, summary=summary)
        fitted = self._fit(conversation, items, system=model_data.instructions or "")
        if summary.strip():
            fitted.insert(0, {"role": "system", "content": SUMMARY_MARK + summary})
        sent: Any = fitted  # the SDK's item TypedDicts are plain dicts at run time
        return ModelInputData(input=sent, instructions=model_data.instructions)

    async def _keep_summary(self, version: int, summary: str, covered: int) -> None:
        """Store the new summary and what it covers, unless the session moved on (the next
        read folds again: the summary is a cache of the items, never their only copy)."""
        try:
            await self.state.aupdate(
                self.session_id,
                {"summary": summary, "summarized": covered},
                expected_version=version,
            )
        except ConflictError:
            return


def _newest(items: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most the newest ``limit`` items: the cut moves later while an output after it has
    its call before it, so no output is sent without its call."""
    start = max(0, len(items) - max(limit, 0))
    while start < len(items):
        called = {i.get("call_id") for i in items[start:] if i.get("type") == "function_call"}
        orphaned = any(
            item.get("type") == "function_call_output" and item.get("call_id") not in called
            for item in items[start:]
        )
        if not orphaned:
            break
        start += 1
    return items[start:]
