"""The agent's privacy policy applied to what a turn stores and shows: one masker, one tenant."""

from __future__ import annotations

from collections.abc import Callable

from keel.messages import Message, ToolCall
from keel.privacy import PIIMasker, StreamMasker
from keel.runtime._text import sanitize

__all__ = ["Masking"]


class Masking:
    """Masks PII and secrets in text, tool calls and messages for one tenant (``masker``
    None: masking is off, text passes through, made storable)."""

    def __init__(self, masker: PIIMasker | None, tenant_id: str) -> None:
        self.masker = masker
        self.tenant_id = tenant_id
        self.redact: Callable[[str], str] | None = None if masker is None else self.mask
        """What the tool journal masks with, as the messages are (None: off)."""

    def mask(self, text: str) -> str:
        if self.masker is None or not text:
            return text
        return self.masker.mask_text(text, tenant_id=self.tenant_id)

    def mask_call(self, call: ToolCall) -> ToolCall:
        arguments = self.mask(sanitize(call.arguments))
        return (
            call
            if arguments == call.arguments
            else call.model_copy(update={"arguments": arguments})
        )

    def mask_message(self, message: Message) -> Message:
        content = self.mask(sanitize(message.content))
        calls = tuple(self.mask_call(call) for call in message.tool_calls)
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    def stream_masker(self) -> StreamMasker | None:
        """A masker for text that arrives in pieces (None: masking is off)."""
        policy, tenant_id = self.masker, self.tenant_id
        if policy is None:
            return None
        return StreamMasker(
            # Each call masks a longer prefix, never seen again: not worth caching.
            lambda whole: policy.mask_text(sanitize(whole), tenant_id=tenant_id, remember=False),
            by_word=policy.streams_by_word(tenant_id),
        )
