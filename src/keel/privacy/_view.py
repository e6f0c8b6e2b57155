"""One user's privacy view for one unit of work: how keel masks what it stores and reveals what
it shows.

Every entrance that stores or shows a user's text (a turn, a decision on one of its calls, a
memory write from HTTP, MCP or [`keel.memory.Memory.add`][], an adapter's call, the
service's reads) gets a [`PrivacyView`][] from [`privacy_view`][] and goes through it, so
there is one answer to "which placeholder does this value get, and who may read it back":

- With a vault, a value is numbered through the user's [`UserVault`][]: it
  has one placeholder in every turn, checkpoint, trace, memory record and decision of that
  user, its value sealed. A read reveals the user's own placeholders; another user's, an
  erased one or an unknown one stays as written.
- Without one, placeholders are numbered per text (``<EMAIL_1>`` is the first address of that
  text), or across every text of the view with ``per_call``; nothing is revealed.

A view lives as long as its unit of work: it holds the user's data key (through its
``UserVault``) and a memo of the texts it masked, and neither outlives it. Its async methods
keep the vault's reads and writes off the event loop ([`VaultStore.acall`][]).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from keel.errors import PlaceholderError
from keel.messages import Message, ToolCall
from keel.privacy._masker import PIIMasker
from keel.privacy._vault import (
    PLACEHOLDER,
    UserVault,
    Vault,
    defang_placeholders,
    placeholders_in,
    placeholders_written,
)

__all__ = ["PrivacyView", "message_placeholders", "privacy_view", "storable"]

_MASKED_KEPT = 512
_MASKED_TEXT_CHARS = 16_384
"""Bounds of one view's memo of masked texts (entries, and the length of a text kept)."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

_Payload = TypeVar("_Payload")


def storable(text: str) -> str:
    """Text that can be stored: lone surrogates (legal in JSON, not in UTF-8) become U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def message_placeholders(message: Message) -> frozenset[str]:
    """The placeholders a model is shown in ``message``: those written in its content and in
    its tool calls' arguments (what [`PrivacyView.note_shown`][] notes of it)."""
    if not message.tool_calls:
        return placeholders_written((message.content,))
    return placeholders_written((message.content, *(call.arguments for call in message.tool_calls)))


def privacy_view(
    masker: PIIMasker | None,
    tenant_id: str,
    user_id: str | None = None,
    vault: Vault | None = None,
    *,
    per_call: bool = False,
) -> PrivacyView:
    """The view of ``user_id`` of ``tenant_id`` for one unit of work: numbered through their
    view of ``vault`` when there is a vault and a user, else masking alone (``per_call``: one
    numbering across the view's texts, see [`PrivacyView`][])."""
    user_vault = None if vault is None or not user_id else vault.user(tenant_id, user_id)
    return PrivacyView(masker, tenant_id, user_vault, per_call=per_call)


_SLOT_MARK = "\ue000"
_SLOT = re.compile("\ue000([0-9]+)\ue000")
"""Where a finding goes in a text masked on the event loop before its values are placed in
the vault off it (a private-use character: a text holding one is masked off the loop whole)."""


class PrivacyView:
    """Masks and reveals one user's text for one unit of work (see the module).

    Args:
        masker: the privacy policy (None: masking is off, text passes through).
        tenant_id: the tenant whose policy applies.
        user_vault: the user's view of the vault (None: placeholders per text, values gone,
            nothing revealed).
        per_call: without a vault, number placeholders across every text this view masks
            (two different addresses in two items of one write are ``<EMAIL_1>`` and
            ``<EMAIL_2>``) instead of per text.
    """

    def __init__(
        self,
        masker: PIIMasker | None,
        tenant_id: str,
        user_vault: UserVault | None = None,
        *,
        per_call: bool = False,
    ) -> None:
        self.masker = masker
        self.tenant_id = tenant_id
        self.user_vault = user_vault
        self._numbers: dict[tuple[str, str], str] | None = (
            {} if per_call and user_vault is None else None
        )
        self._masked: dict[str, str] = {}
        """The texts masked through the user's vault, with their masked form: a unit of work
        masks the same texts several times (a turn's log, its trace, its journal), and a text
        holding a value is never kept by the masker's own cache, which outlives the unit."""

    @property
    def user_id(self) -> str | None:
        """Whose values this view reveals (None without a vault)."""
        return None if self.user_vault is None else self.user_vault.user_id

    @property
    def reveals(self) -> bool:
        """Whether reads give values back (a vault is in use)."""
        return self.user_vault is not None

    # --- values -> placeholders -----------------------------------------------------------------

    def mask(self, text: str) -> str:
        """``text`` as it may be stored (blocking: with a vault, new values are written to it)."""
        if self.masker is None or not text:
            return text
        if self.user_vault is None:
            if self._numbers is not None:
                return self.masker.mask_text(text, tenant_id=self.tenant_id, numbering=self._number)
            return self.masker.mask_text(text, tenant_id=self.tenant_id)
        masked = self._masked.get(text)
        if masked is None:
            # A text's values are placed in one write of the vault (its batch numbering).
            masked = self.masker.mask_text(
                text, tenant_id=self.tenant_id, batch_numbering=self.user_vault.placeholders
            )
            self._keep(text, masked)
        return masked

    async def amask(self, text: str) -> str:
        """[`mask`][] for an event loop: the text's values are found in place and placed in
        the vault off the loop (a write, a round trip on PostgreSQL), in one call for the
        text; a text with none (most of them, and every text masked before) never leaves it."""
        user_vault = self.user_vault
        if self.masker is None or not text or user_vault is None:
            return self.mask(text)
        masked = self._masked.get(text)
        if masked is not None:
            return masked
        if _SLOT_MARK in text:
            return await user_vault.vault.store.acall(functools.partial(self.mask, text))
        found: list[tuple[str, str]] = []

        def slots(values: Sequence[tuple[str, str]]) -> list[str]:
            found.extend(values)
            return [f"{_SLOT_MARK}{index}{_SLOT_MARK}" for index in range(len(values))]

        # The masker numbers a text's findings in one call, and keeps no text it numbered
        # that held a value: the slots never outlive this call.
        template = self.masker.mask_text(text, tenant_id=self.tenant_id, batch_numbering=slots)
        if not found:
            return template
        placed = await user_vault.vault.store.acall(
            functools.partial(user_vault.placeholders, found)
        )
        masked = _SLOT.sub(lambda slot: placed[int(slot.group(1))], template)
        self._keep(text, masked)
        return masked

    async def aplace(self, texts: Iterable[str | None]) -> None:
        """Place the values of ``texts`` in the vault off the event loop, ahead of code that
        masks them synchronously on it (a tracer's record): those masks then find them in
        this view's memo."""
        if self.user_vault is None or self.masker is None:
            return
        for text in texts:
            if text:
                await self.amask(text)

    def _keep(self, text: str, masked: str) -> None:
        if len(self._masked) < _MASKED_KEPT and len(text) <= _MASKED_TEXT_CHARS:
            self._masked[text] = masked

    def mask_value(self, value: Any) -> Any:
        """``value`` (JSON-like: strings, mappings, sequences) with every string masked."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, Mapping):
            return {str(name): self.mask_value(item) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.mask_value(item) for item in value]
        return value

    def untrusted(self, text: str) -> str:
        """``text`` that a model or a tool wrote, with the placeholders in it that keel neither
        placed nor showed the model in this unit of work defanged: they stand for none of the
        user's values ([`UserVault.note_shown`][]); as it is before a prompt was shown."""
        if self.user_vault is None:
            return text
        return self.user_vault.defang_foreign(text)

    def note_shown(
        self, messages: Iterable[Message], *, placeholders: Iterable[str] | None = None
    ) -> None:
        """Note the placeholders of ``messages`` (a prompt about to be sent) as shown to the
        model: from now on this view resolves and reveals those and the ones it placed, no
        other. ``placeholders``: those of ``messages`` when the caller knows them already (a
        compiled prompt's, kept as its history grew: see
        [`CompiledPrompt`][keel.context.CompiledPrompt]): then no message is scanned, and a
        turn's cost does not grow with the window."""
        if self.user_vault is None:
            return
        if placeholders is not None:
            self.user_vault.note_placeholders_shown(placeholders)
            return
        self.user_vault.note_shown(
            text
            for message in messages
            for text in (message.content, *(call.arguments for call in message.tool_calls))
        )

    def mask_untrusted(self, text: str) -> str:
        """[`mask`][] of what a model or a tool wrote ([`untrusted`][] first)."""
        return self.mask(self.untrusted(text))

    async def amask_untrusted(self, text: str) -> str:
        """[`mask_untrusted`][] for an event loop (see [`amask`][])."""
        return await self.amask(self.untrusted(text))

    def mask_tool_output(self, text: str) -> str:
        """[`mask`][] of what a tool returned into a framework's history (an adapter's
        write: a LangGraph ``ToolMessage``, an Agents SDK tool output, a pydantic-ai tool
        return). The framework's tools and model were given the user's values, never
        placeholders, so with a vault every placeholder-shaped text in it is the tool's own:
        defanged, it is never revealed as the user's value when the history is read. Without
        a vault nothing is revealed, and a history stored so keeps its placeholders."""
        if self.user_vault is not None:
            text = defang_placeholders(text)
        return self.mask(text)

    def _content(self, message: Message) -> str:
        """A message's content before masking: the user's own words are theirs, a model's or a
        tool's may spell out placeholders keel did not place."""
        content = storable(message.content)
        return self.untrusted(content) if message.role in ("assistant", "tool") else content

    def mask_call(self, call: ToolCall) -> ToolCall:
        """A call a model made, its arguments masked ([`untrusted`][] first; the very same
        call when nothing changed)."""
        arguments = self.mask_untrusted(storable(call.arguments))
        return (
            call
            if arguments == call.arguments
            else call.model_copy(update={"arguments": arguments})
        )

    def mask_message(self, message: Message) -> Message:
        """``message`` with its content and tool calls masked (the very same one when nothing
        changed)."""
        content = self.mask(self._content(message))
        calls = tuple(self.mask_call(call) for call in message.tool_calls)
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    async def amask_call(self, call: ToolCall) -> ToolCall:
        """[`mask_call`][] for an event loop (see [`amask`][])."""
        arguments = await self.amask_untrusted(storable(call.arguments))
        return (
            call
            if arguments == call.arguments
            else call.model_copy(update={"arguments": arguments})
        )

    async def amask_message(self, message: Message) -> Message:
        """[`mask_message`][] for an event loop (see [`amask`][])."""
        content = await self.amask(self._content(message))
        calls = tuple([await self.amask_call(call) for call in message.tool_calls])
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    def _number(self, entity: str, value: str) -> str:
        assert self._numbers is not None
        key = (entity, value)
        found = self._numbers.get(key)
        if found is None:
            count = sum(1 for known in self._numbers if known[0] == entity) + 1
            found = self._numbers[key] = f"<{entity}_{count}>"
        return found

    # --- placeholders -> values -----------------------------------------------------------------

    def reveal(self, text: str) -> str:
        """``text`` with the user's own placeholders shown as their values (what the user
        reads); as it is without a vault."""
        if self.user_vault is None or not text:
            return text
        return self.user_vault.reveal(text)

    async def areveal(self, text: str) -> str:
        """[`reveal`][], its read of the vault off the event loop."""
        if self.user_vault is None or not text or PLACEHOLDER.search(text) is None:
            return text
        return await self.user_vault.vault.store.acall(
            functools.partial(self.user_vault.reveal, text)
        )

    def reveal_arguments(self, arguments: str) -> str:
        """JSON arguments with each string revealed (a value may hold a quote)."""
        if self.user_vault is None or PLACEHOLDER.search(arguments) is None:
            return arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return self.reveal(arguments)
        return json.dumps(_mapped_strings(parsed, self.reveal), ensure_ascii=False)

    def reveal_value(self, value: Any) -> Any:
        """``value`` (JSON-like: strings, mappings, sequences) with the user's placeholders
        in every string revealed; the very same object without a vault."""
        if self.user_vault is None:
            return value
        if isinstance(value, str):
            return self.reveal(value)
        if isinstance(value, Mapping):
            return {name: self.reveal_value(item) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.reveal_value(item) for item in value]
        return value

    def reveal_message(self, message: Message) -> Message:
        """``message`` with its content and tool calls' arguments revealed."""
        content = self.reveal(message.content)
        calls = tuple(
            call.model_copy(update={"arguments": self.reveal_arguments(call.arguments)})
            for call in message.tool_calls
        )
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    async def areveal_output(self, output: Any) -> Any:
        """A structured answer (a model, a dataclass, a dict, a list, a string) with the
        user's placeholders in its strings shown as their values; its types are kept."""
        if self.user_vault is None or output is None:
            return output
        reveal = functools.partial(_changed_output, output, self.reveal)
        return await self.user_vault.vault.store.acall(reveal)

    async def amask_output(self, output: Any) -> Any:
        """A structured answer (see [`areveal_output`][]) with every string in it masked as
        what a model wrote is ([`mask_untrusted`][]), off the event loop: as its JSON text
        is stored, for a caller who may not read the user's values; its types are kept."""
        if self.masker is None or output is None:
            return output
        mask = functools.partial(_changed_output, output, self.mask_untrusted)
        if self.user_vault is None:
            return mask()
        return await self.user_vault.vault.store.acall(mask)

    async def revealed(self, payload: _Payload) -> _Payload:
        """``payload`` (JSON-ready: dicts, lists, strings) with every placeholder the user can
        resolve replaced by its value, in every string it holds; another user's, erased or
        unknown placeholders stay as written. The values are read in one look-up, off the
        event loop."""
        viewer = self.user_vault
        if viewer is None:
            return payload
        found = list(dict.fromkeys(p for text in _strings(payload) for p in placeholders_in(text)))
        if not found:
            return payload
        values = await viewer.vault.store.acall(functools.partial(_resolvable, viewer, found))
        if not values:
            return payload
        replaced: _Payload = _replaced(payload, values)
        return replaced

    def stamp(self) -> bytes | None:
        """What changes when the user's data key does (created, erased by ``forget``): a
        cache of revealed values is only good while this stays the same."""
        if self.user_vault is None:
            return None
        vault = self.user_vault
        found = vault.vault.store.data_key(vault.tenant_id, vault.user_id)
        return None if found is None else found.wrapped


def _resolvable(viewer: UserVault, placeholders: list[str]) -> dict[str, str]:
    """The values of those of ``placeholders`` that ``viewer`` resolves (all at once when it
    resolves them all, one by one to leave the others out otherwise)."""
    try:
        return viewer.values(placeholders)
    except PlaceholderError:
        pass
    values: dict[str, str] = {}
    for placeholder in placeholders:
        try:
            values.update(viewer.values([placeholder]))
        except PlaceholderError:
            continue
    return values


def _strings(payload: Any) -> Iterator[str]:
    if isinstance(payload, str):
        yield payload
    elif isinstance(payload, dict):
        for item in payload.values():
            yield from _strings(item)
    elif isinstance(payload, list | tuple):
        for item in payload:
            yield from _strings(item)


def _replaced(payload: Any, values: dict[str, str]) -> Any:
    if isinstance(payload, str):
        return PLACEHOLDER.sub(lambda match: values.get(match.group(0), match.group(0)), payload)
    if isinstance(payload, dict):
        return {name: _replaced(item, values) for name, item in payload.items()}
    if isinstance(payload, list | tuple):
        return [_replaced(item, values) for item in payload]
    return payload


def _mapped_strings(value: Any, change: Callable[[str], str]) -> Any:
    """Parsed JSON with ``change`` applied to every string in it, keys included (a dict may
    be keyed by an address)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {
            (change(name) if isinstance(name, str) else name): _mapped_strings(item, change)
            for name, item in value.items()
        }
    if isinstance(value, list):
        return [_mapped_strings(item, change) for item in value]
    return value


def _changed_output(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` (a validated structured answer: a model, a dataclass, a dict, a list, a
    string) with ``change`` (a reveal, a mask) applied to every string in it; its types are
    kept."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        return value.model_copy(
            update={name: _changed_output(item, change) for name, item in fields.items()}
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {
            field.name: _changed_output(getattr(value, field.name), change)
            for field in dataclasses.fields(value)
            if field.init
        }
        return dataclasses.replace(value, **changed)
    if isinstance(value, dict):
        return {key: _changed_output(item, change) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_changed_output(item, change) for item in value]
        # A named tuple takes its fields one by one.
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
