"""The agent's privacy policy applied to what a turn stores and shows: one masker, one tenant,
and with a PII vault one user.

Without a vault, placeholders are numbered per text (``<EMAIL_1>`` is the first address of
that text) and the values are gone. With one, :meth:`Masking.for_user` gives the turn its
user's view of the vault: every mask numbers through it, so a value has one placeholder in
every turn, checkpoint, trace, journal row and memory record of that user, and the values can
come back where they are needed: for the tools (the executor resolves their arguments), for the
model when the deployment trusts it (``model_sees="values"``), and for the user's own reply.
Only placeholders keel placed come back: the prompt the model is shown is noted
(:meth:`Masking.afor_model`), and what the model and the tools write is stored with the other
placeholders it spells out defanged (:meth:`Masking.mask_untrusted`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from keel.errors import UsageError
from keel.messages import Message, ToolCall
from keel.privacy import (
    PLACEHOLDER,
    NoVault,
    PIIMasker,
    RevealStream,
    StreamMasker,
    UserVault,
    Vault,
)
from keel.runtime._text import sanitize
from keel.tracing import Tracer, redact_json

__all__ = ["Masking", "ModelSees", "checked_model_sees"]

_MASKED_KEPT = 512
_MASKED_TEXT_CHARS = 16_384
"""Bounds of one turn's memo of masked texts (entries, and the length of a text kept)."""

ModelSees = Literal["placeholders", "values"]
"""What the model is shown of the user's PII: placeholders (the default), or the values (for
a model the deployment trusts with them, a local one say; needs a vault)."""


def checked_model_sees(model_sees: ModelSees, vault: Vault | None) -> ModelSees:
    """``model_sees``, once it is known to be a policy the agent can keep.

    Raises:
        UsageError: not one of :data:`ModelSees`, or values without a vault to hold them.
    """
    if model_sees not in ("placeholders", "values"):
        raise UsageError(f"model_sees is 'placeholders' or 'values', got {model_sees!r}")
    if model_sees == "values" and vault is None:
        raise UsageError(
            "model_sees='values' needs a PII vault (vault=..., or KEEL_PII_KEY for the stores "
            "to open one): without it, masked values are gone"
        )
    return model_sees


class Masking:
    """Masks PII and secrets in text, tool calls and messages for one tenant (``masker``
    None: masking is off, text passes through, made storable).

    Args:
        masker: the privacy policy.
        tenant_id: the tenant whose policy applies.
        vault: the deployment's PII vault (None: placeholders per text, values gone).
        model_sees: what the model is shown (see :data:`ModelSees`).
        user_vault: the turn's user's view of ``vault`` (set by :meth:`for_user`).
        no_vault: what refuses tool calls holding placeholders while masking has no vault
            (the agent's, so that it warns once for the agent; default: one of its own).
    """

    def __init__(
        self,
        masker: PIIMasker | None,
        tenant_id: str,
        vault: Vault | None = None,
        model_sees: ModelSees = "placeholders",
        *,
        user_vault: UserVault | None = None,
        no_vault: NoVault | None = None,
    ) -> None:
        self.masker = masker
        self.tenant_id = tenant_id
        self.vault = vault
        self.model_sees = checked_model_sees(model_sees, vault)
        self.user_vault = user_vault
        self._masked: dict[str, str] = {}
        """The texts this turn's masking has masked through the user's vault, with their masked
        form: a turn masks the same texts several times (its log, its trace, its journal), and
        a text holding a value is never kept by the masker's own cache, which outlives the
        turn. This one lives as long as the turn's view of the vault (and its data key)."""
        self.redact: Callable[[str], str] | None = None if masker is None else self.mask
        """What the tool journal masks with, as the messages are (None: off)."""
        self.no_vault = (no_vault or NoVault()) if masker is not None and vault is None else None
        """Placeholders without a vault: a tool call holding one is refused."""

    @property
    def tool_vault(self) -> UserVault | NoVault | None:
        """What resolves a tool call's placeholders: the user's vault, :class:`NoVault` when
        this masking writes placeholders no vault keeps, None when masking is off."""
        return self.user_vault if self.user_vault is not None else self.no_vault

    def for_user(self, user_id: str) -> Masking:
        """The masking of one turn of ``user_id``: numbered through their view of the vault
        (this masking itself when there is no vault)."""
        if self.vault is None:
            return self
        return Masking(
            self.masker,
            self.tenant_id,
            self.vault,
            self.model_sees,
            user_vault=self.vault.user(self.tenant_id, user_id),
        )

    # --- values -> placeholders -----------------------------------------------------------------

    def mask(self, text: str) -> str:
        if self.masker is None or not text:
            return text
        if self.user_vault is None:
            return self.masker.mask_text(text, tenant_id=self.tenant_id)
        masked = self._masked.get(text)
        if masked is None:
            # A text's values are placed in one write of the vault (its batch numbering).
            masked = self.masker.mask_text(
                text, tenant_id=self.tenant_id, batch_numbering=self.user_vault.placeholders
            )
            if len(self._masked) < _MASKED_KEPT and len(text) <= _MASKED_TEXT_CHARS:
                self._masked[text] = masked
        return masked

    def mask_untrusted(self, text: str) -> str:
        """:meth:`mask` for text a model or a tool wrote: the placeholders in it that keel
        neither placed nor showed the model in this turn are defanged first (they stand for
        none of the user's values: see :meth:`UserVault.note_shown`)."""
        if self.user_vault is not None:
            text = self.user_vault.defang_foreign(text)
        return self.mask(text)

    def mask_call(self, call: ToolCall) -> ToolCall:
        """A call the model made, as it may be stored (:meth:`mask_untrusted`)."""
        arguments = self.mask_untrusted(sanitize(call.arguments))
        return (
            call
            if arguments == call.arguments
            else call.model_copy(update={"arguments": arguments})
        )

    def mask_message(self, message: Message) -> Message:
        content = sanitize(message.content)
        # The user's own words are theirs; a model's or a tool's may spell out placeholders.
        untrusted = message.role in ("assistant", "tool")
        content = self.mask_untrusted(content) if untrusted else self.mask(content)
        calls = tuple(self.mask_call(call) for call in message.tool_calls)
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    def traced(self, tracer: Tracer) -> Tracer:
        """``tracer`` for one turn: what it records is masked through the user's numbering
        first (then by its own redaction), so the trace holds the placeholders the state does."""
        if self.user_vault is None or self.masker is None:
            return tracer
        # A shallow copy for the turn (same store and exporters): only its redaction is the
        # user's. Its failure counters are the turn's own, not the agent tracer's.
        turn_tracer = copy.copy(tracer)
        own = tracer.redact
        mask = self.mask
        turn_tracer.redact = lambda text: own(mask(text))
        return turn_tracer

    def stream_masker(self) -> StreamMasker | RevealStream | None:
        """A masker for text that arrives in pieces (None: masking is off). With a vault the
        pieces are the user's to read, as the reply is: their placeholders revealed (never
        split), and a value the model wrote out shown as written (the reply reveals the
        placeholder it is stored under)."""
        user_vault = self.user_vault
        if user_vault is not None:
            # As the reply will be: a placeholder the model was not shown is defanged.
            return RevealStream(lambda text: self.reveal(user_vault.defang_foreign(sanitize(text))))
        policy, tenant_id = self.masker, self.tenant_id
        if policy is None:
            return None
        return StreamMasker(
            # Each call masks a longer prefix, never seen again: not worth caching.
            lambda whole: policy.mask_text(sanitize(whole), tenant_id=tenant_id, remember=False),
            by_word=policy.streams_by_word(tenant_id),
        )

    # --- placeholders -> values -----------------------------------------------------------------

    def reveal(self, text: str) -> str:
        """``text`` with the user's own placeholders shown as their values (what the user
        reads); as it is without a vault."""
        if self.user_vault is None or not text:
            return text
        return self.user_vault.reveal(text)

    async def areveal(self, text: str) -> str:
        """:meth:`reveal`, its read of the vault off the event loop (a round trip on
        PostgreSQL)."""
        if self.user_vault is None or not text or PLACEHOLDER.search(text) is None:
            return text
        return await self.user_vault.vault.store.arun(
            functools.partial(self.user_vault.reveal, text)
        )

    async def areveal_output(self, output: Any) -> Any:
        """A structured answer (``output_type``) with the user's placeholders in its strings
        shown as their values, for the caller; as it is without a vault."""
        if self.user_vault is None or output is None:
            return output
        reveal = functools.partial(_revealed_output, output, self.reveal)
        return await self.user_vault.vault.store.arun(reveal)

    async def afor_model(self, messages: Sequence[Message]) -> list[Message]:
        """:meth:`for_model`, the vault read off the event loop when there is one to do. The
        placeholders in ``messages`` are noted as shown to the model: from now on the turn
        resolves and reveals those and the ones it placed, no other."""
        if self.user_vault is not None:
            self.user_vault.note_shown(
                text
                for message in messages
                for text in (message.content, *(call.arguments for call in message.tool_calls))
            )
        if self.model_sees != "values" or self.user_vault is None:
            return list(messages)
        return await self.user_vault.vault.store.arun(functools.partial(self.for_model, messages))

    def for_model(self, messages: Sequence[Message]) -> list[Message]:
        """The compiled prompt as the model is shown it: revealed when the deployment trusts
        the model with values, else as compiled (placeholders). Nothing revealed is stored."""
        if self.model_sees != "values" or self.user_vault is None:
            return list(messages)
        return [self._revealed(message) for message in messages]

    def _revealed(self, message: Message) -> Message:
        content = self.reveal(message.content)
        calls = tuple(
            call.model_copy(update={"arguments": self._revealed_arguments(call.arguments)})
            for call in message.tool_calls
        )
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    def _revealed_arguments(self, arguments: str) -> str:
        """JSON arguments with each string revealed (a value may hold a quote)."""
        if PLACEHOLDER.search(arguments) is None:
            return arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return self.reveal(arguments)
        return json.dumps(redact_json(parsed, self.reveal), ensure_ascii=False)


def _revealed_output(value: Any, reveal: Callable[[str], str]) -> Any:
    """``value`` (a validated structured answer: a model, a dataclass, a dict, a list, a
    string) with ``reveal`` applied to every string in it; its types are kept."""
    if isinstance(value, str):
        return reveal(value)
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        return value.model_copy(
            update={name: _revealed_output(item, reveal) for name, item in fields.items()}
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {
            field.name: _revealed_output(getattr(value, field.name), reveal)
            for field in dataclasses.fields(value)
            if field.init
        }
        return dataclasses.replace(value, **changed)
    if isinstance(value, dict):
        return {key: _revealed_output(item, reveal) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_revealed_output(item, reveal) for item in value]
        # A named tuple takes its fields one by one.
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
