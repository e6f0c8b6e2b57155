"""The agent's privacy policy applied to what a turn stores and shows: one masker, one tenant,
and with a PII vault one user.

The masking and revealing itself is the turn's [`PrivacyView`][], the one
every entrance uses. Without a vault, placeholders are numbered per text (``<EMAIL_1>`` is the
first address of that text) and the values are gone. With one, `Masking.for_user` gives
the turn its user's view: every mask numbers through it, so a value has one placeholder in
every turn, checkpoint, trace, journal row and memory record of that user, and the values can
come back where they are needed: for the tools (the executor resolves their arguments), for the
model when the deployment trusts it (``model_sees="values"``), and for the user's own reply.
Only placeholders keel placed come back: the prompt the model is shown is noted
(`Masking.afor_model`), and what the model and the tools write is stored with the other
placeholders it spells out defanged (`Masking.mask_untrusted`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from keel.errors import UsageError
from keel.messages import Message, ToolCall
from keel.privacy import (
    NoVault,
    PIIMasker,
    PrivacyView,
    RevealStream,
    StreamMasker,
    UserVault,
    Vault,
    storable,
)
from keel.tracing import LoopStep, Tracer

__all__ = ["Masking", "ModelSees", "checked_model_sees"]

_HELD = "\ue001"
"""Marks a model endpoint held out of masking (a private-use character, as the vault's own
slots are, and not theirs)."""
_HELD_MARK = re.compile("\ue001([0-9]+)\ue001")


def _put_back(masked: str, held: Sequence[str]) -> str:
    """``masked`` with each held endpoint where its mark is."""
    if not held:
        return masked
    return _HELD_MARK.sub(lambda mark: held[int(mark.group(1))], masked)


ModelSees = Literal["placeholders", "values"]
"""What the model is shown of the user's PII: placeholders (the default), or the values (for
a model the deployment trusts with them, a local one say; needs a vault)."""


def checked_model_sees(model_sees: ModelSees, vault: Vault | None) -> ModelSees:
    """``model_sees``, once it is known to be a policy the agent can keep.

    Raises:
        UsageError: not one of `ModelSees`, or values without a vault to hold them.
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
    """The agent's privacy policy for one tenant, and with a vault one turn's user: the
    [`PrivacyView`][] a turn masks and reveals through (``view``), with what
    only a turn needs besides (what the model is shown, the tracer, streamed text).

    Args:
        masker: the privacy policy (None: masking is off, text passes through, made storable).
        tenant_id: the tenant whose policy applies.
        vault: the deployment's PII vault (None: placeholders per text, values gone).
        model_sees: what the model is shown (see `ModelSees`).
        user_vault: the turn's user's view of ``vault`` (set by `for_user`).
        endpoints: the model's own server addresses, as configured (its base URL): kept as
            written where `mask` finds them, so that an error about the server names it
            (``cannot reach http://10.0.0.5:8000/v1``). They are the deployment's
            configuration, not user data; everything else in the text is masked as before.
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
        endpoints: Sequence[str] = (),
    ) -> None:
        self.masker = masker
        self.tenant_id = tenant_id
        self.vault = vault
        self.model_sees = checked_model_sees(model_sees, vault)
        self.view = PrivacyView(masker, tenant_id, user_vault)
        """The turn's view: every mask and reveal goes through it (and its memo of masked
        texts lives as long as the turn's view of the vault and its data key)."""
        self.redact: Callable[[str], str] | None = None if masker is None else self.mask
        """What the tool journal masks with, as the messages are (None: off)."""
        self.no_vault = (no_vault or NoVault()) if masker is not None and vault is None else None
        """Placeholders without a vault: a tool call holding one is refused."""
        self.endpoints = tuple(sorted({e for e in endpoints if e}, key=len, reverse=True))

    @property
    def tool_vault(self) -> UserVault | NoVault | None:
        """What resolves a tool call's placeholders: the user's vault, [`NoVault`][] when
        this masking writes placeholders no vault keeps, None when masking is off."""
        return self.user_vault if self.user_vault is not None else self.no_vault

    @property
    def user_vault(self) -> UserVault | None:
        """The turn's user's view of the vault (None: no vault, or not one user's masking)."""
        return self.view.user_vault

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
            endpoints=self.endpoints,
        )

    # --- values -> placeholders -----------------------------------------------------------------

    def mask(self, text: str) -> str:
        """``text`` as it may be stored (blocking: see `amask` on an event loop); the
        model's own ``endpoints`` stay as written."""
        held, text = self._hold_endpoints(text)
        return _put_back(self.view.mask(text), held)

    async def amask(self, text: str) -> str:
        """`mask`, a write of new values to the vault off the event loop."""
        held, text = self._hold_endpoints(text)
        return _put_back(await self.view.amask(text), held)

    def _hold_endpoints(self, text: str) -> tuple[list[str], str]:
        """``text`` with each of the model's endpoints in it replaced by a mark no detector
        finds, and the endpoints in the marks' order."""
        held: list[str] = []
        if not text:
            return held, text
        for endpoint in self.endpoints:
            if endpoint in text:
                text = text.replace(endpoint, f"{_HELD}{len(held)}{_HELD}")
                held.append(endpoint)
        return held, text

    def mask_untrusted(self, text: str) -> str:
        """`mask` for text a model or a tool wrote (see
        [`untrusted`][keel.privacy.PrivacyView.untrusted])."""
        return self.view.mask_untrusted(text)

    async def amask_untrusted(self, text: str) -> str:
        """`mask_untrusted`, a write of new values to the vault off the event loop."""
        return await self.view.amask_untrusted(text)

    def mask_call(self, call: ToolCall) -> ToolCall:
        return self.view.mask_call(call)

    def mask_message(self, message: Message) -> Message:
        return self.view.mask_message(message)

    async def amask_message(self, message: Message) -> Message:
        """`mask_message`, a write of new values to the vault off the event loop."""
        return await self.view.amask_message(message)

    async def aplace_step(self, step: LoopStep) -> None:
        """Place the values of what the trace records of ``step`` (the model's output, each
        call's arguments and result, the errors) in the vault off the event loop: the turn
        tracer masks them on it, synchronously, and then finds them in the view's memo."""
        texts = [step.raw_output, step.error]
        for result in step.tool_results:
            texts.extend((result.raw_arguments, result.output_text, result.error))
        await self.view.aplace(texts)

    def traced(self, tracer: Tracer) -> Tracer:
        """``tracer`` for one turn: what it records is masked through the user's view first
        (then by its own redaction), so the trace holds the placeholders the state does."""
        if self.user_vault is None or self.masker is None:
            return tracer
        # A shallow copy for the turn (same store and exporters): only its redaction is the
        # user's. Its failure counters are the turn's own, not the agent tracer's.
        turn_tracer = copy.copy(tracer)
        own = tracer.redact
        mask = self.view.mask
        if self._is_policy(own):
            # The tracer's own redaction is this very policy: what the view masked, it finds
            # nothing more in (a trace records some forty texts a turn; one pass each).
            turn_tracer.redact = mask
        else:
            turn_tracer.redact = lambda text: own(mask(text))
        return turn_tracer

    def _is_policy(self, redact: Callable[[str], str]) -> bool:
        """Whether ``redact`` is this masking's policy for its tenant, as the factories give
        the agent's tracer (``functools.partial(masker.mask_text, tenant_id=...)``)."""
        return (
            isinstance(redact, functools.partial)
            and self.masker is not None
            and redact.func == self.masker.mask_text
            and not redact.args
            and redact.keywords == {"tenant_id": self.tenant_id}
        )

    def stream_masker(self) -> StreamMasker | RevealStream | None:
        """A masker for text that arrives in pieces (None: masking is off). With a vault the
        pieces are the user's to read, as the reply is: their placeholders revealed (never
        split), and a value the model wrote out shown as written (the reply reveals the
        placeholder it is stored under)."""
        if self.user_vault is not None:
            # As the reply will be: a placeholder the model was not shown is defanged.
            view = self.view
            return RevealStream(lambda text: view.reveal(view.untrusted(storable(text))))
        policy, tenant_id = self.masker, self.tenant_id
        if policy is None:
            return None
        return StreamMasker(
            # Each call masks a longer prefix, never seen again: not worth caching.
            lambda whole: policy.mask_text(storable(whole), tenant_id=tenant_id, remember=False),
            by_word=policy.streams_by_word(tenant_id),
            spans=lambda whole: policy.mask_spans(storable(whole), tenant_id=tenant_id),
        )

    # --- placeholders -> values -----------------------------------------------------------------

    def reveal(self, text: str) -> str:
        """``text`` with the user's own placeholders shown as their values (what the user
        reads); as it is without a vault."""
        return self.view.reveal(text)

    async def areveal(self, text: str) -> str:
        """`reveal`, its read of the vault off the event loop (a round trip on
        PostgreSQL)."""
        return await self.view.areveal(text)

    async def areveal_output(self, output: Any) -> Any:
        """A structured answer (``output_type``) with the user's placeholders in its strings
        shown as their values, for the caller; as it is without a vault."""
        return await self.view.areveal_output(output)

    async def afor_model(
        self, messages: Sequence[Message], placeholders: frozenset[str] | None = None
    ) -> Sequence[Message]:
        """`for_model`, the vault read off the event loop when there is one to do. The
        placeholders in ``messages`` (``placeholders`` when the compiled prompt knows them)
        are noted as shown to the model: from now on the turn resolves and reveals those and
        the ones it placed, no other."""
        self.view.note_shown(messages, placeholders=placeholders)
        user_vault = self.user_vault
        if self.model_sees != "values" or user_vault is None:
            return messages
        return await user_vault.vault.store.acall(functools.partial(self.for_model, messages))

    def for_model(self, messages: Sequence[Message]) -> Sequence[Message]:
        """The compiled prompt as the model is shown it: revealed when the deployment trusts
        the model with values, else as compiled (placeholders), ``messages`` themselves (the
        model gets its own copy from ``ChatModel``: one here would cost the window again).
        Nothing revealed is stored."""
        if self.model_sees != "values" or self.user_vault is None:
            return messages
        return [self.view.reveal_message(message) for message in messages]
