"""Carrying out one tool call: look up, repair, validate, run once, cap, never crash.

Every outcome is a [`ToolResult`][]: the text the model sees next (``content``) and every
fact a trace needs. The model always gets something it can act on: the closest valid tool
names, the JSON problem, one line per invalid field, or the tool's own failure.

With a user's PII vault, placeholders in a call's arguments (``<EMAIL_1>``) are resolved to
that user's values once the arguments are parsed, before they are validated (an ``EmailStr``
validates the real address), and only for the call's own tenant and user: the tool runs with the
values while the journal, the result's arguments and the history keep the placeholders. A
placeholder that cannot be resolved stops the call before anything is journalled or run: one
the user's vault does not hold, one the model did not get from keel (it took it from a tool's
output or a document, see [`note_shown`][keel.privacy.UserVault.note_shown]), and any placeholder at
all where the agent masks without a vault ([`NoVault`][]). What a tool returns
(or raises) is text keel did not write: its placeholder-shaped substrings are defanged
([`defang_placeholders`][]) before the model, the journal or the user see it,
except the placeholders the call itself carried.

A side-effecting call that may have taken effect without a recorded result (it outlived its
timeout, its run was cancelled, the process died) stays *in doubt* in the journal; a
non-idempotent one is never run again until it is settled, not under its own key and not as
the same call (same session, tool and arguments) made again at a later step. When the thread
of a timed-out call finishes after all, its real result is journalled and settles it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer
from pydantic_core import to_jsonable_python

from keel._model_json import (
    ArgumentsNotJSONError,
    coerce_scalars,
    format_validation_error,
    parse_arguments,
)
from keel.errors import (
    KeelError,
    PlaceholderError,
    StoreError,
    ToolArgumentsError,
    ToolExecutionError,
    ToolInDoubtError,
    ToolNotRunError,
    UnknownToolError,
)
from keel.messages import Message, ToolCall
from keel.privacy import PLACEHOLDER, NoVault, UserVault, defang_placeholders, placeholders_in
from keel.privacy._masker import maskable_json
from keel.privacy._vault import FOREIGN_REASON
from keel.tools._journal import (
    SETTLED_NOTE,
    InMemoryJournal,
    JournalEntry,
    ToolJournal,
    idempotency_key,
)
from keel.tools._masked_arguments import masked_json
from keel.tools._registry import ToolRegistry
from keel.tools._tool import AbandonedResult, Tool, ToolContext, ToolScope, abandoned_result

__all__ = [
    "CallDispatch",
    "ToolExecutor",
    "ToolResult",
    "ToolStatus",
    "format_validation_error",
    "validated_arguments",
]

ToolStatus = Literal[
    "ok",
    "failed",
    "timeout",
    "unknown_tool",
    "invalid_arguments",
    "in_doubt",
    "blocked",
    "awaiting_approval",
]
"""How a call ended. ``blocked``: a guard refused to run it (a loop was detected).
``awaiting_approval``: not run yet, a person must decide first."""

logger = logging.getLogger("keel.tools")

LATE_NOTE = "[finished after keel had stopped waiting for it] "
"""Starts the journalled content of a call that finished after its timeout (or after its run
was cancelled): the model was told it was in doubt, so a repeat gets this result instead of
running again."""

REPEAT_NOTE = "Not run again: the same call made earlier "
"""Starts the journalled ``content`` of a repeat answered with the result of the call that did
it (see `ToolExecutor._answer_repeat`): nothing ran under that key, so it stands for that call
when the next repeat is judged."""


class CallDispatch:
    """Whether a journalled call has left keel, for a tool that can tell (an MCP tool: its
    request is written to the server's transport, or not yet): one that [`track`][]s it and
    was still waiting to be sent at its timeout never ran (a plain failure, not in doubt), and
    is never sent after. Thread-safe: the request may be written on another thread's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Literal["untracked", "waiting", "sent", "abandoned"] = "untracked"

    def track(self) -> None:
        """The tool says when its call is sent."""
        with self._lock:
            if self._state == "untracked":
                self._state = "waiting"

    def may_send(self) -> bool:
        """Right before the call is sent: False once the executor gave up on it."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "sent"
            return True

    def not_sent(self) -> None:
        """The send failed after all (nothing reached the other side)."""
        with self._lock:
            if self._state == "sent":
                self._state = "waiting"

    def give_up(self) -> bool:
        """The executor stops waiting: True when the call was tracked and never sent (and now
        never will be)."""
        with self._lock:
            if self._state != "waiting":
                return False
            self._state = "abandoned"
            return True


call_dispatch: contextvars.ContextVar[CallDispatch | None] = contextvars.ContextVar(
    "keel_call_dispatch", default=None
)
"""Set by the executor around a journalled call (a context variable, as ``abandoned_result``,
so wrappers of ``ainvoke`` carry it)."""


_TRUNCATION_MARKER = "\n[output truncated: {total} characters, the first {shown} shown]"


class ToolResult(BaseModel):
    """The outcome of one tool call, for the model (``content``) and for traces (the rest)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    call_id: str = Field(description="The id of the call this answers.")
    tool: str = Field(description="The tool name as the model wrote it.")
    status: ToolStatus = Field(description="How the call ended.")
    content: str = Field(description="What the model is shown: output (capped) or the problem.")
    raw_arguments: str = Field(description="The arguments exactly as the model wrote them.")
    arguments: dict[str, Any] | None = Field(
        default=None, description="The validated arguments, when they validated."
    )
    repairs: tuple[str, ...] = Field(
        default=(), description="Repairs made to the arguments before they validated."
    )
    problems: tuple[str, ...] = Field(
        default=(), description="One line per problem with the arguments ('Field 'x': ...')."
    )
    output: Any = Field(default=None, description="The tool's return value, uncapped.")
    output_text: str = Field(default="", description="The whole output as text, uncapped.")
    truncated: bool = Field(default=False, description="True when content was capped.")
    error: str | None = Field(default=None, description="The error message, when not ok.")
    error_type: str | None = Field(default=None, description="The error's class name.")
    exception: KeelError | None = Field(
        default=None, exclude=True, description="The typed error, for callers that raise it."
    )
    idempotency_key: str | None = Field(
        default=None, description="The journal key, for side-effecting tools."
    )
    executed: bool = Field(default=False, description="True when the function ran this time.")
    replayed: bool = Field(
        default=False, description="True when the result came from the journal, not a new run."
    )
    attempt: int = Field(default=0, ge=0, description="Which start of the tool this was.")
    latency_ms: float = Field(default=0.0, ge=0, description="Wall time of the call.")

    @field_serializer("output")
    def _serialize_output(self, output: Any) -> Any:
        # Traces must serialize whatever a tool returned; unknown types become their str().
        return to_jsonable_python(output, fallback=str)

    @property
    def ok(self) -> bool:
        """True when the tool ran (now or before a crash) and returned."""
        return self.status == "ok"

    def to_message(self) -> Message:
        """The tool message that answers the call."""
        return Message.tool(self.call_id, self.content, name=self.tool)


class ToolExecutor:
    """Runs tool calls against a registry, with a journal for side-effecting tools.

    Args:
        registry: the tools the model may call.
        journal: where side-effecting calls are journalled; default an in-memory journal
            (exactly-once within the process only; pass a SQLite or PostgreSQL journal for
            crash safety).
        timeout_s: default per-call timeout for tools that declare none.
        max_output_chars: default output cap for tools that declare none.
        redact: masks every text written to the journal (a call's arguments, its content and
            output), e.g. a [`PIIMasker`][] or the agent's masking function;
            a replayed call returns the masked content. ``None`` (the default) journals the
            texts as they are. The result the model gets now is not masked here: the agent
            masks messages at its door.
        aredact: ``redact`` for the event loop (the agent's masking writes a new value to the
            PII vault, a round trip on a server): used where the executor runs on the loop;
            ``redact`` where it does not (a late result recorded from the tool's thread).
        vault: the user's view of the PII vault: placeholders in a call's arguments are
            resolved to their values for the tool (see the module docstring; a tool declared
            ``sees_values=False`` gets them as written). [`NoVault`][]: the
            agent masks without a vault, so a call holding a placeholder is not made. None:
            arguments are used as written.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        *,
        journal: ToolJournal | None = None,
        timeout_s: float = 30.0,
        max_output_chars: int = 4000,
        redact: Callable[[str], str] | None = None,
        scope: ToolScope | None = None,
        vault: UserVault | NoVault | None = None,
        aredact: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.registry = registry
        self.vault = vault
        self.journal = journal if journal is not None else InMemoryJournal()
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.redact = redact
        self.aredact = aredact
        self.scope = scope or ToolScope()

    def _masked(self, text: str) -> str:
        """``text`` as the journal may keep it (blocking: off the event loop)."""
        return text if self.redact is None or not text else self.redact(text)

    async def _amasked(self, text: str) -> str:
        """`_masked` on the event loop: through ``aredact`` when there is one."""
        if self.redact is None or not text:
            return text
        return self.redact(text) if self.aredact is None else await self.aredact(text)

    async def execute(
        self,
        call: ToolCall,
        *,
        session_id: str,
        step: int,
        call_index: int = 0,
        turn_id: str | None = None,
        on_start: Callable[[dict[str, Any]], None] | None = None,
    ) -> ToolResult:
        """Carry out ``call``; every failure comes back as a result, never as an exception.

        ``on_start`` is called with the validated arguments right before the tool runs (not
        for a call refused, or answered from the journal).

        The exceptions that do propagate are cancellation and process-level ones
        (``KeyboardInterrupt``): a side-effecting call interrupted that way stays *in doubt*
        in the journal, which is the truth.
        """
        started = time.perf_counter()
        base: dict[str, Any] = {
            "call_id": call.id,
            "tool": call.name,
            "raw_arguments": call.arguments,
        }
        found = self.registry.get(call.name)
        if found is None:
            return self._unknown_tool(call.name, base, started)
        try:
            values = await self._vault_values(found, call.arguments)
        except PlaceholderError as exc:
            return _unresolved(found, base, started, exc)
        checked = _check_arguments(found, call.arguments, base, started, values)
        if isinstance(checked, ToolResult):
            return checked
        validated, repairs = checked
        if not found.sees_values and self.redact is not None:  # nor a value the model wrote
            masked = await masked_json(validated.model_dump(mode="json"), self._amasked)
            checked = _check_arguments(found, maskable_json(masked), base, started, values)
            if isinstance(checked, ToolResult):
                return checked
            validated = checked[0]
        # What is journalled, traced and streamed keeps the placeholders; the tool gets values.
        arguments = _with_placeholders(validated.model_dump(mode="json"), values)
        base.update(arguments=arguments, repairs=repairs)
        context = self.call_context(
            call, session_id=session_id, step=step, call_index=call_index, turn_id=turn_id
        )
        if found.side_effect:
            base["idempotency_key"] = context.idempotency_key
            claimed = await self._claim(
                found, arguments, base, started, session_id, step, call_index
            )
            if isinstance(claimed, ToolResult):
                return claimed
            context = dataclasses.replace(context, attempt=claimed.attempts)
        if on_start is not None:
            on_start(arguments)
        return await self._run(
            found, validated, context, base, started, journalled=found.side_effect
        )

    def call_context(
        self,
        call: ToolCall,
        *,
        session_id: str,
        step: int,
        call_index: int = 0,
        turn_id: str | None = None,
    ) -> ToolContext:
        """The context ``call`` runs with, its journal key included: the one place both are
        built, so that what decides whether a call may run (an approval policy) sees the call
        as the tool will (a first start: a journalled retry counts its attempts)."""
        return ToolContext(
            session_id=session_id,
            step=step,
            call_index=call_index,
            call_id=call.id,
            idempotency_key=idempotency_key(session_id, step, call_index, turn_id),
            user_id=self.scope.user_id,
            tenant_id=self.scope.tenant_id,
            run_id=self.scope.run_id,
            deps=self.scope.deps,
        )

    def _unknown_tool(self, name: str, base: dict[str, Any], started: float) -> ToolResult:
        """The model named no tool there is: the closest names, and every name, to pick from."""
        suggestions = self.registry.suggest(name)
        hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
        available = ", ".join(self.registry.names) or "none"
        return _refused(
            base,
            started,
            "unknown_tool",
            f"Error: there is no tool named {name!r}.{hint} Available tools: {available}.",
            UnknownToolError(name, suggestions),
        )

    async def _claim(
        self,
        found: Tool,
        arguments: dict[str, Any],
        base: dict[str, Any],
        started: float,
        session_id: str,
        step: int,
        call_index: int,
    ) -> JournalEntry | ToolResult:
        """Journal the intent of a side-effecting call before it runs: the entry to run it
        under, or the result that answers it without running (a replay, a refusal)."""
        key = base["idempotency_key"]
        try:
            # Masking is deterministic, so identical calls stay identical in the journal.
            canonical = await self._amasked(maskable_json(arguments))
        except Exception as exc:
            # Raw arguments never reach the journal, and without an intent the call is not run.
            unmasked = ToolExecutionError(
                f"tool {found.name!r} was not run: masking its arguments for the journal "
                f"failed ({type(exc).__name__})"
            )
            unmasked.__cause__ = exc
            return _not_recorded(found, base, started, "masking its arguments failed", unmasked)
        try:
            if not found.idempotent and await self.journal.aget(key) is None:
                earlier = await self._earlier_same_call(found, session_id, key, canonical)
                if earlier is not None:
                    return await self._answer_repeat(
                        found, earlier, base, started, step, call_index
                    )
            claim = await self.journal.aclaim(
                key=key,
                session_id=session_id,
                step=step,
                call_index=call_index,
                tool=found.name,
                arguments=canonical,
            )
            if not claim.created and claim.entry.in_doubt and found.idempotent:
                claim = claim.model_copy(update={"entry": await self.journal.arestart(key)})
        except StoreError as exc:
            # Without a durable intent the call could run twice after a crash: do not run it.
            return _not_recorded(found, base, started, "the journal is unavailable", exc)
        if claim.created:
            return claim.entry
        return _from_journal(found, claim.entry, base, started) or claim.entry

    async def _vault_values(self, found: Tool, raw: str) -> dict[str, str]:
        """The user's values for the placeholders in a call's raw arguments (none for a tool
        that does not see values, or without a vault).

        Raises:
            PlaceholderError: one is not the user's, was erased, or fails to decrypt.
        """
        if self.vault is None or not found.sees_values:
            return {}
        wanted = _placeholders_to_resolve(found, raw)
        # One read of the store for the whole call, off the event loop (a round trip on
        # PostgreSQL).
        if not wanted:
            return {}
        if isinstance(self.vault, NoVault):
            raise self.vault.refusal(wanted[0])
        return await self.vault.vault.store.acall(functools.partial(self.vault.values, wanted))

    def _untrusted(self, text: str, base: dict[str, Any]) -> str:
        """``text`` (a tool's output or error) as keel lets it in: its placeholder-shaped
        substrings defanged, but those the call carried (a tool that is given placeholders may
        echo them)."""
        if self.vault is None or "<" not in text:
            return text
        return defang_placeholders(text, keep=frozenset(placeholders_in(base["raw_arguments"])))

    async def _earlier_same_call(
        self, found: Tool, session_id: str, key: str, arguments: str
    ) -> JournalEntry | None:
        """An earlier identical call (same session, tool, canonical arguments; another key)
        that forbids running this one: one still in doubt, or else the newest one that ran if
        it was settled as done after the model was told it was in doubt (the model never saw it
        done): by its own late result, or by an operator. Every repeat of it then gets its
        result, the second as the first (a repeat answered so ran nothing). Settled as failed,
        it did not happen, and the repeat runs."""
        same = await self.journal.asame_calls(session_id, found.name, arguments)
        earlier = [entry for entry in same if entry.key != key]
        doubtful = [e for e in earlier if e.in_doubt]
        if doubtful:
            return doubtful[0]
        # A repeat answered before ran nothing: the call it was answered with is the one to
        # judge, or its journalled answer would let the next repeat run the effect again.
        ran = [e for e in earlier if not (e.content or "").startswith(REPEAT_NOTE)]
        if ran and ran[-1].ok and _settled_late(ran[-1]):
            return ran[-1]
        return None

    async def _answer_repeat(
        self,
        found: Tool,
        earlier: JournalEntry,
        base: dict[str, Any],
        started: float,
        step: int,
        call_index: int,
    ) -> ToolResult:
        """Refuse to run a repeat of an in-doubt call; answer a repeat of a call that finished
        late with that call's result (journalled under the new key, so a resume agrees)."""
        if earlier.in_doubt:
            doubt = ToolInDoubtError(
                found.name,
                earlier.key,
                why=(
                    f"the same call with the same arguments ({earlier.key}, step "
                    f"{earlier.step}) may or may not have taken effect and is not settled"
                ),
            )
            return _refused(
                base,
                started,
                "in_doubt",
                f"Error: tool {found.name!r} was not run: the same call made earlier "
                f"(call {earlier.key}) may or may not have taken effect, and an operator has "
                "been asked to check. Do not call it again; tell the user it is being checked.",
                doubt,
                attempt=earlier.attempts,
            )
        done = (earlier.content or "").removeprefix(LATE_NOTE)
        output = (earlier.output or "").removeprefix(SETTLED_NOTE) or done
        content = f"{REPEAT_NOTE}(call {earlier.key}) did it: {done}"
        key = base["idempotency_key"]
        claim = await self.journal.aclaim(
            key=key,
            session_id=earlier.session_id,
            step=step,
            call_index=call_index,
            tool=found.name,
            arguments=earlier.arguments,
        )
        if claim.created:
            await self.journal.afinish(key, ok=True, content=content, output=output)
        return ToolResult(
            **base,
            status="ok",
            content=content,
            output_text=output,
            replayed=True,
            attempt=earlier.attempts,
            latency_ms=_ms(started),
        )

    def _late_recorder(
        self, found: Tool, context: ToolContext, cap: int, base: dict[str, Any]
    ) -> AbandonedResult:
        """What to do when the thread of a call keel stopped waiting for finishes after all:
        record its real outcome, unless the entry was settled meanwhile (by an operator)."""
        key = context.idempotency_key

        def record(ok: bool, value: Any) -> None:
            entry = self.journal.get(key)
            if entry is None or not entry.in_doubt:
                return
            if ok:
                text = self._masked(self._untrusted(_as_text(value), base))
                shown, _ = _cap(text, cap)
                self.journal.finish(key, ok=True, content=LATE_NOTE + shown, output=text)
            else:
                content = self._masked(
                    f"Error: tool {found.name!r} failed after keel stopped waiting for it: "
                    + self._untrusted(f"{type(value).__name__}: {value}", base)
                )
                self.journal.finish(key, ok=False, content=content, output=content)
            logger.warning(
                "tool call %s (%s) finished after keel stopped waiting for it; its result is "
                "now journalled (%s)",
                key,
                found.name,
                "succeeded" if ok else "failed",
            )

        return record

    async def _record(
        self, context: ToolContext, *, ok: bool, output: str, cap: int | None = None
    ) -> None:
        """Journal the result: ``output`` whole, and capped to ``cap`` as the model's content.

        The output is masked before it is capped, so a cut cannot leave the start of a secret
        that the masker no longer recognises.
        """
        try:
            masked = await self._amasked(output)
        except Exception:
            # The raw result must not be kept instead: the call stays in doubt, as below.
            logger.exception(
                "tool call %s ran but its result could not be masked; it stays in doubt",
                context.idempotency_key,
            )
            return
        content = masked if cap is None else _cap(masked, cap)[0]
        try:
            await self.journal.afinish(
                context.idempotency_key, ok=ok, content=content, output=masked
            )
        except StoreError:
            # The call ran; only its record is missing, so it stays in doubt in the journal
            # and an operator settles it. The model still gets the real outcome now.
            logger.exception(
                "tool call %s ran but its result could not be journalled; it stays in doubt",
                context.idempotency_key,
            )

    async def _failed(
        self,
        found: Tool,
        context: ToolContext,
        base: dict[str, Any],
        started: float,
        exc: Exception,
        journalled: bool,
    ) -> ToolResult:
        why = self._untrusted(f"{type(exc).__name__}: {exc}", base)
        failure = ToolExecutionError(f"tool {found.name!r} failed: {why}")
        failure.__cause__ = exc
        content = f"Error: {failure}"
        if journalled:
            await self._record(context, ok=False, output=content)
        return _refused(
            base, started, "failed", content, failure, executed=True, attempt=context.attempt
        )

    async def _not_run(
        self,
        found: Tool,
        context: ToolContext,
        base: dict[str, Any],
        started: float,
        exc: ToolNotRunError,
        journalled: bool,
    ) -> ToolResult:
        """A call that provably never left keel: a plain failure, journalled as failed (so
        neither listed in doubt nor refused when made again)."""
        why = self._untrusted(str(exc), base)
        failure = ToolNotRunError(f"tool {found.name!r} was not run: {why}")
        failure.__cause__ = exc
        content = f"Error: {failure}. Nothing happened; it can be tried again later."
        if journalled:
            await self._record(context, ok=False, output=content)
        return _refused(base, started, "failed", content, failure, attempt=context.attempt)

    async def _run(
        self,
        found: Tool,
        validated: BaseModel,
        context: ToolContext,
        base: dict[str, Any],
        started: float,
        *,
        journalled: bool,
    ) -> ToolResult:
        timeout = found.timeout_s if found.timeout_s is not None else self.timeout_s
        cap = (
            found.max_output_chars if found.max_output_chars is not None else self.max_output_chars
        )
        failure: ToolExecutionError | None = None
        output: Any = None
        deadline = asyncio.timeout(timeout)
        # A sync tool's thread outlives a timeout (and a cancelled run): when it finishes, its
        # real outcome goes to the journal instead of nowhere.
        token = abandoned_result.set(
            self._late_recorder(found, context, cap, base) if journalled else None
        )
        dispatch = CallDispatch() if journalled else None
        dispatched = call_dispatch.set(dispatch)
        try:
            # asyncio.timeout, not wait_for: wait_for can swallow an outer cancellation.
            async with deadline:
                output = await found.ainvoke(validated, context)
        except TimeoutError as exc:
            if not deadline.expired():
                # The tool's own TimeoutError (a socket, say): a failure like any other.
                return await self._failed(found, context, base, started, exc, journalled)
            if dispatch is not None and dispatch.give_up():
                # Still waiting to be sent (its server down): it never ran, and now never will.
                unsent = ToolNotRunError(
                    f"it could not be sent within {timeout:g} s (its server was unavailable)"
                )
                return await self._not_run(found, context, base, started, unsent, journalled)
            if journalled:
                # It may have taken effect (and its thread may still be running): the intent
                # stays in the journal without a result, in doubt, which is the truth.
                return self._in_doubt(
                    found, context, base, started, f"did not finish within {timeout:g} s"
                )
            failure = ToolExecutionError(
                f"tool {found.name!r} did not finish within {timeout:g} s."
            )
            status: ToolStatus = "timeout"
        except ToolNotRunError as exc:
            # The tool knows its call never left keel (its server was down): not in doubt.
            return await self._not_run(found, context, base, started, exc, journalled)
        except ToolInDoubtError as exc:
            # The tool itself cannot tell whether it took effect (its server died mid-call).
            if not journalled:
                return await self._failed(found, context, base, started, exc, journalled)
            return self._in_doubt(found, context, base, started, exc.why)
        except Exception as exc:
            return await self._failed(found, context, base, started, exc, journalled)
        finally:
            abandoned_result.reset(token)
            call_dispatch.reset(dispatched)
        if failure is not None:
            return _refused(
                base,
                started,
                status,
                f"Error: {failure}",
                failure,
                executed=True,
                attempt=context.attempt,
            )
        text = self._untrusted(_as_text(output), base)
        shown, truncated = _cap(text, cap)
        if journalled:
            await self._record(context, ok=True, output=text, cap=cap)
        return ToolResult(
            **base,
            status="ok",
            content=shown,
            output=output,
            output_text=text,
            truncated=truncated,
            executed=True,
            attempt=context.attempt,
            latency_ms=_ms(started),
        )

    def _in_doubt(
        self,
        found: Tool,
        context: ToolContext,
        base: dict[str, Any],
        started: float,
        why: str,
    ) -> ToolResult:
        """A side-effecting call that may have taken effect (it outlived its timeout, its
        server died mid-call): in doubt, never a plain failure."""
        key = context.idempotency_key
        if found.idempotent:
            # Running it again is harmless by its declaration: the model may retry.
            failure = ToolExecutionError(
                f"tool {found.name!r} {why}. It may or may not "
                "have taken effect; it is safe to call it again."
            )
            return _refused(
                base,
                started,
                "timeout",
                f"Error: {failure}",
                failure,
                executed=True,
                attempt=context.attempt,
            )
        doubt = ToolInDoubtError(found.name, key, why=f"it {why} and may have taken effect")
        return _refused(
            base,
            started,
            "in_doubt",
            f"Error: tool {found.name!r} {why}; it may or may "
            "not have taken effect. It will not be run again; an operator has been asked "
            "to check. Do not call it again.",
            doubt,
            executed=True,
            attempt=context.attempt,
        )


def _settled_late(entry: JournalEntry) -> bool:
    """Whether ``entry`` was settled after the model was told it was in doubt: by the late
    result of its own thread, or by an operator."""
    return (entry.content or "").startswith(LATE_NOTE) or (entry.output or "").startswith(
        SETTLED_NOTE
    )


def _refused(
    base: dict[str, Any],
    started: float,
    status: ToolStatus,
    content: str,
    error: KeelError,
    **fields: Any,
) -> ToolResult:
    """A result that carries ``error`` as its typed exception, its message and its class."""
    return ToolResult(
        **base,
        status=status,
        content=content,
        error=str(error),
        error_type=type(error).__name__,
        exception=error,
        latency_ms=_ms(started),
        **fields,
    )


def _check_arguments(
    found: Tool,
    raw: str,
    base: dict[str, Any],
    started: float,
    values: dict[str, str] | None = None,
) -> tuple[BaseModel, tuple[str, ...]] | ToolResult:
    """The arguments parsed, repaired, their placeholders replaced by ``values`` (the vault's,
    resolved beforehand) and validated (with the repairs made), or the result that tells the
    model what to fix."""
    try:
        parsed = parse_arguments(raw)
    except ArgumentsNotJSONError as exc:
        return _refused(
            base,
            started,
            "invalid_arguments",
            f"Error: the arguments for tool {found.name!r} are not usable: {exc}. "
            "Call the tool again with one JSON object, one key per parameter.",
            ToolArgumentsError(found.name, [str(exc)]),
            problems=(str(exc),),
        )
    value = _resolved(parsed.value, found.masked_arguments, values) if values else parsed.value
    value, coerced = coerce_scalars(value, found._parameters)
    repairs = (*parsed.repairs, *coerced)
    try:
        return found.args_model.model_validate(value), repairs
    except ValidationError as exc:
        problems = format_validation_error(exc)
        if any("Extra inputs are not permitted" in line for line in problems):
            problems.append("Valid arguments: " + ", ".join(found.args_model.model_fields) + ".")
        return _refused(
            base,
            started,
            "invalid_arguments",
            f"Error: invalid arguments for tool {found.name!r}:\n"
            + "\n".join(problems)
            + "\nFix these fields and call the tool again.",
            ToolArgumentsError(found.name, problems),
            repairs=repairs,
            problems=tuple(problems),
        )


def _placeholders_to_resolve(found: Tool, raw: str) -> list[str]:
    """The placeholders in a call's arguments that the tool gets as values: all but those
    under its ``masked_arguments`` (none when the arguments are not JSON: validation says so)."""
    if PLACEHOLDER.search(raw) is None:
        return []
    try:
        value = parse_arguments(raw).value
    except ArgumentsNotJSONError:
        return []
    if isinstance(value, dict):
        value = {name: item for name, item in value.items() if name not in found.masked_arguments}
    found_placeholders: list[str] = []

    def collect(text: str) -> str:
        found_placeholders.extend(placeholders_in(text))
        return text

    _map_strings(value, collect)
    return found_placeholders


def _resolved(value: Any, kept: tuple[str, ...], values: dict[str, str]) -> Any:
    """``value`` (parsed arguments) with the placeholders in its strings replaced by their
    ``values``, except under the top-level names ``kept``."""

    def substitute(text: str) -> str:
        return PLACEHOLDER.sub(lambda match: values.get(match.group(0), match.group(0)), text)

    if isinstance(value, dict):
        return {
            name: item if name in kept else _map_strings(item, substitute)
            for name, item in value.items()
        }
    return _map_strings(value, substitute)


def _with_placeholders(value: Any, values: dict[str, str]) -> Any:
    """``value`` with each resolved value written as its placeholder again (longest first)."""
    if not values:
        return value
    longest_first = sorted(values.items(), key=lambda item: -len(item[1]))

    def masked(text: str) -> str:
        for placeholder, real in longest_first:
            if real:
                text = text.replace(real, placeholder)
        return text

    return _map_strings(value, masked)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` (JSON data) with ``change`` applied to every string in it."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    if isinstance(value, dict):
        return {name: _map_strings(item, change) for name, item in value.items()}
    return value


def _unresolved(
    found: Tool, base: dict[str, Any], started: float, error: PlaceholderError
) -> ToolResult:
    """A call whose arguments hold a placeholder the user's vault cannot resolve: not made."""
    advice = (
        "use only the placeholders the user's own messages hold, never one a tool's output "
        "or a document spells out"
        if error.reason == FOREIGN_REASON
        else f"ask the user for the value {error.placeholder} stands for, or go on without it"
    )
    return _refused(
        base,
        started,
        "invalid_arguments",
        f"Error: tool {found.name!r} was not called: {error}. Nothing was done; {advice}.",
        error,
        problems=(str(error),),
    )


def validated_arguments(
    found: Tool, raw: str, values: Mapping[str, str] | None = None
) -> BaseModel:
    """``raw`` parsed, repaired and validated as the executor does a model's arguments (an
    approver's corrected arguments, say); ``values``: the user's values for its placeholders,
    put in before validation as the executor does ([`avalidated_arguments`][]).

    Raises:
        ToolArgumentsError: one line per problem.
    """
    base: dict[str, Any] = {"call_id": "", "tool": found.name, "raw_arguments": raw}
    checked = _check_arguments(found, raw, base, time.perf_counter(), dict(values or {}))
    if isinstance(checked, ToolResult):
        assert isinstance(checked.exception, ToolArgumentsError)
        raise checked.exception
    return checked[0]


def _from_journal(
    found: Tool, entry: JournalEntry, base: dict[str, Any], started: float
) -> ToolResult | None:
    """The answer to a call whose key the journal already holds: its recorded result, or a
    refusal when a non-idempotent call is in doubt; ``None`` when it may run (again)."""
    if not entry.in_doubt:
        return ToolResult(
            **base,
            status="ok" if entry.ok else "failed",
            content=entry.content or "",
            output_text=entry.output or "",
            error=None if entry.ok else entry.content,
            error_type=None if entry.ok else "ToolExecutionError",
            exception=None if entry.ok else ToolExecutionError(entry.content or ""),
            replayed=True,
            attempt=entry.attempts,
            latency_ms=_ms(started),
        )
    if found.idempotent:
        return None
    return _refused(
        base,
        started,
        "in_doubt",
        f"Error: tool {found.name!r} was started before an interruption and it is unknown "
        "whether it took effect. It was not run again; an operator has been asked to check. "
        "Do not call it again.",
        ToolInDoubtError(found.name, base["idempotency_key"]),
        attempt=entry.attempts,
    )


def _not_recorded(
    found: Tool, base: dict[str, Any], started: float, why: str, error: KeelError
) -> ToolResult:
    """A side-effecting call refused because its intent could not be journalled: not run."""
    return _refused(
        base,
        started,
        "failed",
        f"Error: tool {found.name!r} was not run: its call could not be recorded "
        f"({why}). Nothing happened; it can be tried later.",
        error,
    )


def _as_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, BaseModel):
        return output.model_dump_json()
    try:
        return json.dumps(output, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(output)


def _cap(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + _TRUNCATION_MARKER.format(total=len(text), shown=limit), True


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


async def avalidated_arguments(
    found: Tool, raw: str, vault: UserVault | NoVault | None
) -> BaseModel:
    """[`validated_arguments`][] with the placeholders of ``raw`` resolved in ``vault`` first,
    exactly as the executor will before it runs the call (what decides whether a call may run
    must see the arguments it will run with).

    Raises:
        ToolArgumentsError: one line per problem.
        PlaceholderError: a placeholder the user's vault cannot resolve, or any placeholder
            without a vault (the executor will not make the call either).
    """
    values: dict[str, str] = {}
    if vault is not None and found.sees_values:
        wanted = _placeholders_to_resolve(found, raw)
        if wanted and isinstance(vault, NoVault):
            raise vault.refusal(wanted[0])
        if wanted and isinstance(vault, UserVault):
            values = await vault.vault.store.acall(functools.partial(vault.values, wanted))
    return validated_arguments(found, raw, values)
