"""The model's half of a loop step: a journalled decision replayed, or the model called (its
text streamed when the driver asks), its reply checked, a cut answer continued, and what the
reply means for the run (see `keel.runtime._loop_run`); and its inputs for one turn
(`TurnPrompt`): each step's prompt compiled from the session's conversation, and its generation
options sized to the room that prompt left."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from keel.context import CompiledPrompt, ContextEngine, ContextMemory, Conversation, runtime_note
from keel.errors import MalformedResponseError, ModelError, ModelTimeoutError, StoreError
from keel.guards import (
    GuardConfig,
    LoopDetector,
    SpiralMonitor,
    check_response,
    output_json_schema,
    validate_structured,
)
from keel.messages import Message, Usage
from keel.models import ChatModel, Completion, ModelOptions
from keel.runtime._loop_run import (
    History,
    LoopResult,
    LoopRun,
    LoopStop,
    MaybeAwaitable,
    ModelOutcome,
    StepRecord,
    call_hook,
    decision_scope,
)
from keel.tools import ToolJournal

__all__ = ["ModelStep", "TurnPrompt"]

logger = logging.getLogger("keel.runtime")

_CONTINUE = (
    "Your previous reply was cut off at the token limit. Continue it exactly where it stopped, "
    "mid-word if it stopped mid-word: do not repeat what you wrote, do not start over, and do "
    "not mention the cut."
)
"""What the model is told when its answer was cut at the token limit (keel's words, dropped
from the history when the turn ends: the parts become one answer)."""

_CONTINUE_ECHOES = (_CONTINUE, _CONTINUE.split(". ", 1)[0] + ".")
"""keel's note as a model may echo it back (all of it, or its first sentence): never shown or
kept as the model's words."""


class ModelStep:
    """The model's half of a step (see the module docstring).

    Args:
        model: the chat model.
        journal: where a resumed run finds the decision of its first step.
        guards: the model's timeout and failure cap, the output retries.
        monitor: the death-spiral monitor each model call is recorded in.
        agent: the agent's name, for the monitor.
        output_schema: the type a final answer must be (None: text).
        options: generation options (``timeout_s`` defaults to the guards' model timeout);
            the model is asked for cut answers (``allow_truncated``), which this step
            continues or ends.
    """

    def __init__(
        self,
        model: ChatModel,
        journal: ToolJournal,
        *,
        guards: GuardConfig,
        monitor: SpiralMonitor,
        agent: str | None = None,
        output_schema: type[Any] | None = None,
        options: ModelOptions | None = None,
    ) -> None:
        self.model = model
        self.journal = journal
        self.guards = guards
        self.monitor = monitor
        self.agent = agent
        self.output_schema = output_schema
        base = options or ModelOptions()
        # A cut answer is this loop's to continue, not an error to retry from scratch.
        update: dict[str, Any] = {"allow_truncated": True}
        if base.timeout_s is None:
            update["timeout_s"] = guards.model_timeout_s
        self.options = base.model_copy(update=update)

    def start(
        self,
        messages: Sequence[Message],
        *,
        session_id: str,
        first_step: int,
        turn_id: str | None,
        tools: list[dict[str, Any]],
        decided_before: bool = True,
    ) -> LoopRun:
        """A run from ``messages`` (not copied: see `History`). ``decided_before``: False
        when no run before this one can have journalled a decision under its turn (a turn
        keel has just opened under an id it made): its first step looks nothing up."""
        return LoopRun(
            session_id=session_id,
            turn_id=turn_id,
            decided_before=decided_before,
            history=History(messages),
            started=time.perf_counter(),
            detector=LoopDetector(self.guards),
            tools=tools,
            model=self.model.spec,
            output_schema=self.output_schema,
            monitor=self.monitor,
            agent=self.agent,
            step=first_step,
        )

    async def replay(self, run: LoopRun) -> ModelOutcome | None:
        """The decision journalled for the run's first step, if a run before it recorded one."""
        # Only a run's first step can find a decision journalled before it: a run resumes at
        # the step of its last checkpoint, and a later step is decided by this run (a
        # concurrent writer's decision still wins, when ours is recorded).
        if run.steps or not run.decided_before:
            return None
        try:
            decision = await self.journal.adecision(decision_scope(run), run.step)
        except StoreError:
            # Replay is an optimisation of resume; each side-effecting call is still
            # claimed in the journal before it runs, and refused if that claim cannot be
            # written.
            logger.exception("could not read the journalled decision of step %s", run.step)
            return None
        if decision is None:
            return None
        kind: Literal["tool_calls", "final"] = "tool_calls" if decision.tool_calls else "final"
        return ModelOutcome(kind, None, decision, replayed=True)

    async def ask(
        self,
        run: LoopRun,
        sent: Sequence[Message],
        options: ModelOptions,
        on_text: Callable[[int, str], MaybeAwaitable[None]] | None = None,
    ) -> ModelOutcome:
        """Call the model with ``sent`` (its text streamed to ``on_text`` when given); an
        unusable reply or a failed call is a finished retry step."""
        assert run.current is not None
        run.current["prompt_messages"] = len(sent)
        call = _Call(sent, time.perf_counter())
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the run's own
        # cancellation when the call finishes at the same moment, and the run overruns.
        try:
            async with asyncio.timeout(self.guards.model_timeout_s) as deadline:
                completion = await self._call_model(run, call, options, on_text)
        except TimeoutError as exc:
            reason = (
                f"no answer within {self.guards.model_timeout_s:g} s"
                if deadline.expired()
                else f"the model call timed out: {exc}"
            )
            return self._failure(run, ModelTimeoutError(reason, model=self.model.spec), call)
        except ModelError as exc:
            return self._failure(run, exc, call)
        except Exception as exc:
            # A custom ChatModel that raises something else (a bug, a KeyError): a model
            # failure like any other, never an exception out of the run.
            wrapped = ModelError(
                f"the model raised {type(exc).__name__}: {exc}", model=self.model.spec
            )
            wrapped.__cause__ = exc
            return self._failure(run, wrapped, call)
        completion = _without_note(completion)
        run.usage = run.usage + completion.usage
        self.monitor.record_call(
            session_id=run.session_id,
            agent=self.agent,
            prompt_tokens=completion.usage.prompt_tokens,
            retry=run.retrying,
            ttft_ms=completion.ttft_ms,
        )
        if _cut_at_limit(completion):
            if not self.options.continue_truncated or self._cut_at_model_cap(options):
                return ModelOutcome("cut", completion, completion.message)
            return self._continue_cut(run, completion)
        return self._checked(run, _whole_answer(run, completion))

    def _checked(self, run: LoopRun, completion: Completion) -> ModelOutcome:
        """A complete reply: its calls or answer, or, unusable, a retry with a correction."""
        problem = check_response(completion)
        if problem is not None:
            error = problem.error(self.model.spec)
            run.errors.append(str(error))
            run.last_failure = error
            run.retrying = True
            run.history.append(
                Message.user(problem.correction(), metadata={"keel_correction": problem.kind})
            )
            run.finish(
                "retry",
                completion,
                completion.message,
                error=error,
                events=(f"unusable reply: {problem.detail}",),
            )
            return ModelOutcome("retry", completion, completion.message)
        run.retrying = False
        message = completion.message
        return ModelOutcome("tool_calls" if message.tool_calls else "final", completion, message)

    def _cut_at_model_cap(self, options: ModelOptions) -> bool:
        """Whether a cut answer stopped at the model's own cap (its ``max_answer_tokens``,
        not the room the prompt left): the model was configured to stop there, and asking it
        to go on would only ramble on, one capped part at a time."""
        cap = self.model.max_answer_tokens
        return cap is not None and (options.max_tokens is None or options.max_tokens >= cap)

    async def _call_model(
        self,
        run: LoopRun,
        call: _Call,
        options: ModelOptions,
        on_text: Callable[[int, str], MaybeAwaitable[None]] | None,
    ) -> Completion:
        """One model call: streamed to ``on_text`` when it is set (never keel's own note,
        should the model echo it)."""
        if on_text is None:
            return await self.model.acomplete(call.sent, run.tools, options)
        completion: Completion | None = None
        stream = self.model.astream(call.sent, run.tools, options)
        shown = _NoteFilter()
        try:
            async for chunk in stream:
                if chunk.text:
                    call.produced.append(chunk.text)
                    text = shown.feed(chunk.text)
                    if text:
                        await call_hook(on_text, run.step, text)
                if chunk.completion is not None:
                    completion = chunk.completion
            rest = shown.flush()
            if rest:
                await call_hook(on_text, run.step, rest)
        finally:
            # Stopped early (a timeout, a cancelled turn): the provider's request ends now.
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        if completion is None:
            raise ModelError("the stream ended without a complete answer", model=self.model.spec)
        return completion

    def _continue_cut(self, run: LoopRun, completion: Completion) -> ModelOutcome:
        """A text answer cut at the token limit: kept as written, and the next step asks the
        model to go on from where it stopped (the parts become one answer when it ends)."""
        part = completion.message
        run.cut_parts.append(part.content)
        run.retrying = False
        run.history.append(part)
        # keel's request, in keel's name (not the user's): a correction, gone when the turn ends.
        run.history.append(
            runtime_note(_CONTINUE, reason="continue", metadata={"keel_correction": "continue"})
        )
        run.finish("continued", completion, part)
        return ModelOutcome("continued", completion, part)

    def _failure(self, run: LoopRun, error: ModelError, call: _Call) -> ModelOutcome:
        run.errors.append(f"{type(error).__name__}: {error}")
        run.retrying = True
        run.last_failure = error
        # A reply cut off mid-way still cost tokens and said something: trace both.
        raw = getattr(error, "raw", None)
        partial = raw if isinstance(raw, Completion) else None
        if partial is not None:
            run.usage = run.usage + partial.usage
        self.monitor.record_call(
            session_id=run.session_id,
            agent=self.agent,
            retry=True,
            prompt_tokens=partial.usage.prompt_tokens if partial is not None else 0,
        )
        # What the model wrote before it failed: streamed, or the unusable text itself.
        if partial is None and not call.produced and isinstance(raw, str):
            call.produced.append(raw)
        traced = partial if partial is not None else self._failed_call(run, call)
        run.finish("retry", traced, traced.message, error=error)
        return ModelOutcome("retry", partial, Message.assistant(""))

    def _failed_call(self, run: LoopRun, call: _Call) -> Completion:
        """What the trace records of a call that failed without an answer: how long it took,
        the prompt it was sent (counted here) and what it wrote before failing. Counted by
        keel, not billed by the provider: the run's usage leaves them out."""
        counter = self.model.counter
        try:
            prompt_tokens = counter.count_prompt(call.sent, run.tools)
            produced = "".join(call.produced)
            completion_tokens = counter.count_text(produced) if produced else 0
        except Exception:  # a tokenizer that cannot count this prompt: the duration stands
            logger.debug("could not count the tokens of a failed model call", exc_info=True)
            prompt_tokens = completion_tokens = 0
            produced = ""
        return Completion(
            message=Message.assistant(_strip_note(produced)),
            finish_reason="error",
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            model=self.model.spec,
            latency_ms=(time.perf_counter() - call.started) * 1000,
        )

    def conclude(self, run: LoopRun, outcome: ModelOutcome) -> LoopResult | None:
        """What a step without tool calls means for the run: its result, or None to go on.

        Raises:
            LoopStop: the model kept failing, or the answer cannot be of the output type.
        """
        if outcome.kind == "continued":
            run.failures_in_a_row = 0
            return None
        if outcome.kind == "cut":
            return self._end_cut(run, outcome)
        if outcome.kind == "retry":
            run.failures_in_a_row += 1
            if run.failures_in_a_row >= self.guards.max_model_failures:
                last = run.last_failure or ModelError("the model kept failing")
                raise LoopStop("model_failed", last)
            return None
        run.failures_in_a_row = 0
        return self._answer(run, outcome.completion, outcome.message)

    def _answer(
        self, run: LoopRun, completion: Completion | None, message: Message
    ) -> LoopResult | None:
        """A final answer: the result, or (not of the output type) a retry with each wrong
        field, while retries are left."""
        output: Any = None
        schema = self.output_schema
        if schema is not None:
            checked = validate_structured(message.content, schema)
            if not checked.ok:
                problem = "; ".join(checked.problems)
                run.errors.append(f"structured output invalid: {problem}")
                if run.output_retries >= self.guards.max_output_retries:
                    error = MalformedResponseError(
                        f"the answer does not match {schema.__name__}: {problem}",
                        model=self.model.spec,
                        raw=message.content,
                    )
                    run.finish("stopped", completion, message, error=error, events=(problem,))
                    raise LoopStop("invalid_output", error)
                run.output_retries += 1
                run.history.append(message)
                run.history.append(
                    Message.user(
                        checked.correction(schema), metadata={"keel_correction": "structured"}
                    )
                )
                events = (f"structured output: {problem}",)
                run.finish("retry", completion, message, events=events)
                return None
            output = checked.value
        run.history.append(message)
        run.finish("final", completion, message)
        return run.result("completed", message, output=output)

    def _end_cut(self, run: LoopRun, outcome: ModelOutcome) -> LoopResult:
        """The caller's ``max_tokens`` caps the whole answer (``continue_truncated`` off), or
        the model's own cap cut it: the answer is what was written, reported cut."""
        why = "the answer was cut at the caller's max_tokens"
        if self.options.continue_truncated:
            cap = self.model.max_answer_tokens
            why = f"the answer was cut at the model's max_answer_tokens ({cap})"
        part = outcome.message
        if self.output_schema is not None:
            error = MalformedResponseError(why, model=self.model.spec)
            run.finish("stopped", outcome.completion, part, error=error)
            raise LoopStop("invalid_output", error)
        # The step is final (its streamed text stands) before the part joins any earlier ones.
        run.finish("final", outcome.completion, part, events=(why,))
        run.cut_parts.append(part.content)
        answer = Message.assistant("".join(run.cut_parts))
        run.errors.append(why)
        run.history.append(answer)
        return run.result("completed", answer, truncated=True)


@dataclass
class _Call:
    """One model call in flight: its prompt, when it started, the text it streamed so far."""

    sent: Sequence[Message]
    started: float
    produced: list[str] = field(default_factory=list)


def _strip_note(text: str) -> str:
    """``text`` without keel's continuation note (and the blank after it), where a model
    echoed it as its own words."""
    for echo in _CONTINUE_ECHOES:
        while echo in text:
            before, _, after = text.partition(echo)
            text = before + after.lstrip()
    return text


def _without_note(completion: Completion) -> Completion:
    """``completion`` with keel's continuation note taken out of its text (see
    `_strip_note`)."""
    content = completion.message.content
    if not any(echo in content for echo in _CONTINUE_ECHOES):
        return completion
    message = completion.message.model_copy(update={"content": _strip_note(content)})
    return completion.model_copy(update={"message": message})


class _NoteFilter:
    """Streamed text with keel's continuation note taken out: text that may be the start of
    the note is held back until the next piece says whether it is."""

    def __init__(self) -> None:
        self._held = ""
        self._drop_space = False

    def feed(self, text: str) -> str:
        """What of the stream so far can be shown now."""
        held = self._held + text
        keep = _open_note_prefix(held)
        self._held = held[len(held) - keep :]
        return self._release(held[: len(held) - keep])

    def flush(self) -> str:
        """The rest, at the stream's end."""
        held, self._held = self._held, ""
        return self._release(held)

    def _release(self, text: str) -> str:
        if self._drop_space:
            text = text.lstrip()
            self._drop_space = not text
        shown = _strip_note(text)
        if shown != text and text.rstrip().endswith(_CONTINUE_ECHOES):
            # The note ended the text so far: the blank after it may come in the next piece.
            self._drop_space = True
        return shown


def _open_note_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that begins keel's note without being all
    of it (0: none)."""
    note = _CONTINUE_ECHOES[0]
    start = text.find(note[0], max(0, len(text) - len(note) + 1))
    while start != -1:
        if note.startswith(text[start:]):
            return len(text) - start
        start = text.find(note[0], start + 1)
    return 0


def _whole_answer(run: LoopRun, completion: Completion) -> Completion:
    """``completion`` as the whole answer: after the parts of it the token limit cut, when it
    is the last part of a continued answer (checked, and used, as the whole)."""
    if not run.cut_parts:
        return completion
    whole = "".join(run.cut_parts) + completion.message.content
    run.cut_parts.clear()
    message = completion.message.model_copy(update={"content": whole})
    return completion.model_copy(update={"message": message})


def _cut_at_limit(completion: Completion) -> bool:
    """Whether ``completion`` is a text answer the token limit cut (one to continue; a cut tool
    call is not continued: its arguments are asked for again)."""
    message = completion.message
    return (
        completion.finish_reason == "length"
        and not message.tool_calls
        and bool(message.content.strip())
    )


class TurnPrompt:
    """Compiles a turn's prompts and sizes its model calls.

    Args:
        engine: the context engine (budget, window, summary).
        system_prompt: identity and guardrails.
        rules: the agent's operating rules.
        output_type: the turn's answer type (its schema becomes a rule and an option).
        options: the turn's generation options (the caller's ``max_tokens`` caps the answer).
        max_output_tokens: the model's output limit.
        tools: the schemas of the turn's tools.
    """

    def __init__(
        self,
        engine: ContextEngine,
        *,
        system_prompt: str,
        rules: Sequence[str],
        output_type: type[Any] | None,
        options: ModelOptions,
        max_output_tokens: int,
        tools: list[dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.system_prompt = system_prompt
        self.rules = list(rules)
        if output_type is not None:
            schema = json.dumps(output_json_schema(output_type), ensure_ascii=False)
            self.rules.append(
                "When you give your final answer, reply with only one JSON object that follows "
                f"this JSON schema: {schema}"
            )
        self.options = options
        if output_type is not None and options.json_schema is None:
            # Providers that can enforce a schema do (structured outputs, a grammar).
            self.options = options.model_copy(
                update={"json_schema": output_json_schema(output_type)}
            )
        self.max_output_tokens = max_output_tokens
        self.tools = tools
        self.memories: list[ContextMemory] = []
        self.last: CompiledPrompt | None = None
        self.headroom = 0
        """Tokens the last prompt left free beyond the reserve (see `_headroom`)."""
        self.max_tokens = 0
        """The largest prompt compiled."""
        self._shrink_next = False

    def compile(self, conversation: Conversation, rules: Sequence[str]) -> Sequence[Message]:
        """The next model call's prompt: ``conversation`` within the budget, the agent's rules
        and then ``rules`` (the workflow's), the memories, the tools."""
        self.headroom = self._headroom()
        prompt = self.engine.compile(
            conversation,
            system=self.system_prompt,
            rules=[*self.rules, *rules],
            memories=self.memories,
            tools=self.tools,
            extra_headroom=self.headroom,
        )
        self._shrink_next = False
        self.last = prompt
        self.max_tokens = max(self.max_tokens, prompt.tokens)
        # The compiled tuple itself (it cannot change): a copy would cost the window.
        return prompt.messages

    def sized(self, options: ModelOptions) -> ModelOptions:
        """``options`` with what the next model call may generate (DESIGN.md, "The answer's
        limit"): the room its compiled prompt left in the window, at most the model's output
        limit, never less than the reserve (room no prompt takes); the caller's
        ``max_tokens``, when given, caps it."""
        budget = self.engine.budget
        prompt = self.last
        used = (prompt.tokens if prompt is not None else budget.limit) + self.headroom
        room = min(budget.effective_window - used, self.max_output_tokens)
        room = max(room, budget.reserve, 1)
        asked = self.options.max_tokens
        return options.model_copy(
            update={"max_tokens": room if asked is None else min(asked, room)}
        )

    def note(self, record: StepRecord) -> None:
        """A step ended: the provider saying the prompt was too long shrinks the next one."""
        if record.error_type == "ContextLengthExceededError":
            self._shrink_next = True

    def _headroom(self) -> int:
        """Tokens to leave free beyond the answer reserve in the next prompt: none, unless the
        provider just said the prompt was too long. Our count and theirs then disagree (a
        template or tokenizer we could only estimate): the retry gets a third less room."""
        if not self._shrink_next:
            return 0
        limit = self.engine.budget.limit
        return limit - max(1024, int(limit * 2 / 3))
