"""The bundled local model: SmolLM2-135M-Instruct through llama-cpp-python, offline.

The weights are loaded once per process and shared by every [`LocalModel`][] with the same
settings (loaded on keel's blocking pool, `keel._bridge.run_blocking`). llama.cpp is not
thread-safe for one context, so generations are serialized by a lock; each runs in a thread of
its own (`keel._bridge.run_in_thread`), not on the bounded blocking pool: a generation lasts
seconds, and calls waiting for the lock would otherwise hold the pool's threads, so the event
loop keeps serving while the model thinks and short blocking work never queues behind it.

The model has no native tool calling: tools are described in the system prompt in the
``<tool_call>`` format ([`render_tools_prompt`][]) and the reply is read with
[`parse_tool_calls`][]. What cannot be read lands in
``Completion.tool_call_errors`` instead of raising. ``json_mode``, ``json_schema`` and
``tool_choice="required"`` are enforced with a llama.cpp grammar, so the reply is valid JSON by
construction.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import functools
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel._assets import smollm2_gguf
from keel._bridge import run_blocking, run_in_thread
from keel.errors import (
    ContextLengthExceededError,
    ModelTimeoutError,
    ModelUnavailableError,
    UnknownModelError,
    UsageError,
)
from keel.messages import Message, Usage
from keel.models._answer import StreamedAnswer, refuse_cut_answer, whole_call_deltas
from keel.models._base import (
    ChatModel,
    Completion,
    CompletionChunk,
    FinishReason,
    ModelOptions,
    ToolSchema,
)
from keel.models._toolcalls import parse_tool_calls, render_tool_call, render_tools_prompt
from keel.tokens import counter_for

__all__ = ["LocalModel", "loaded_local_models"]

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system prompt SmolLM2's chat template uses when none is given (token counts match)."""

_END = "<|im_end|>"
DEFAULT_MAX_ANSWER_TOKENS = 384
"""The default cap on one answer of the bundled model (the ``local_max_answer_tokens``
setting): a model this small that has not stopped by then is rambling, and on a CPU every
token costs time (2,048 of them took two minutes)."""


@dataclass
class _Loaded:
    llama: Any
    lock: threading.Lock
    load_s: float
    path: Path
    n_ctx: int


_loaded: dict[tuple[str, int, int], _Loaded] = {}
_loading = threading.Lock()


@atexit.register
def _free_loaded_models() -> None:
    """Free native model memory before interpreter teardown, when llama-cpp-python's own
    finalizers would fail noisily on half-unloaded modules."""
    with _loading:
        while _loaded:
            _, loaded = _loaded.popitem()
            with loaded.lock:
                loaded.llama.close()


def _load(path: Path, n_ctx: int, n_threads: int) -> _Loaded:
    key = (str(path), n_ctx, n_threads)
    with _loading:
        cached = _loaded.get(key)
        if cached is not None:
            return cached
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise ModelUnavailableError(
                "the local model needs llama-cpp-python: pip install 'keel-runtime[local]'",
                model="local:smollm2",
            ) from exc
        started = time.perf_counter()
        try:
            llama = Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                n_batch=512,
                # One token per micro-batch: with larger micro-batches this llama.cpp build
                # evaluated SmolLM2's prompt wrongly (the greedy reply to "Say hello" became a
                # row of emoji) while token-by-token evaluation was right. The prompt costs a
                # little more time; the answer is correct.
                n_ubatch=1,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelUnavailableError(
                f"cannot load {path.name}: {exc}", model="local:smollm2"
            ) from exc
        loaded = _Loaded(llama, threading.Lock(), time.perf_counter() - started, path, n_ctx)
        _loaded[key] = loaded
        return loaded


def loaded_local_models() -> dict[str, float]:
    """The local models loaded in this process: file name -> seconds the load took."""
    return {f"{Path(key[0]).name}@{key[1]}": value.load_s for key, value in _loaded.items()}


def _grammar(schema: dict[str, Any] | None) -> Any:
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

    if schema is None:
        return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)


# Free text may not open a tool call or a JSON object: those go through the call rule, whose
# JSON is the tools' own schemas. "<" is left out entirely (a call's tag cannot start mid-text).
_FREE_TEXT_RULE = "free-text ::= [^<{ \\t\\n] [^<]*\n"


def _call_grammar_text(
    tools: Sequence[ToolSchema], answer: Mapping[str, Any] | None, required: bool
) -> str:
    """A GBNF grammar for a reply that is one well-formed call of one of ``tools`` (its name
    real, its arguments valid for that tool's schema), or else the answer: free text, or JSON
    of ``answer``'s schema when one is given; only the call when ``required``."""
    from llama_cpp.llama_grammar import SchemaConverter

    # llama-cpp-python ships this converter without type hints.
    untyped: Any = SchemaConverter
    converter = untyped(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    calls = []
    for tool in tools:
        function = tool.get("function", tool)
        name = str(function["name"])
        # A copy: resolving rewrites $ref in place. Each tool's $defs resolve against its own
        # schema, not the combined one.
        parameters = copy.deepcopy(dict(function.get("parameters") or {"type": "object"}))
        parameters = converter.resolve_refs(parameters, f"tool:{name}")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        )
    converter.visit({"anyOf": calls}, "tool-call-json")
    # Tagged as the prompt asks. Free to answer, also bare: small models that call at all
    # often open with the JSON itself (a required call stays tagged: SmolLM2 then picks the
    # right tool twice as often, 0.80 against 0.40 on keel bench models' prompts).
    choices = ['"<tool_call>\\n" tool-call-json "\\n</tool_call>"']
    if not required:
        choices.append("tool-call-json")
    extra = ""
    if answer is not None:
        converter.visit(
            converter.resolve_refs(copy.deepcopy(dict(answer)), "answer"), "answer-json"
        )
        choices.append("answer-json")
    elif not required:
        choices.append("free-text")
        extra = _FREE_TEXT_RULE
    rules = converter.format_grammar().rstrip("\n")
    return f"{rules}\nroot ::= {' | '.join(choices)}\n{extra}"


@functools.lru_cache(maxsize=32)
def _cached_call_grammar(key: str) -> Any:
    from llama_cpp.llama_grammar import LlamaGrammar

    tools, answer, required = json.loads(key)
    return LlamaGrammar.from_string(_call_grammar_text(tools, answer, required), verbose=False)


def _call_grammar(
    tools: Sequence[ToolSchema], answer: Mapping[str, Any] | None, required: bool
) -> Any:
    # Agents send the same tools on every call: the grammar is built once per set.
    return _cached_call_grammar(json.dumps([list(tools), answer, required], sort_keys=True))


def _generate_in_thread(
    loop: asyncio.AbstractEventLoop,
    loaded: _Loaded,
    prompt: str,
    max_tokens: int,
    args: dict[str, Any],
) -> tuple[asyncio.Queue[tuple[str, Any]], threading.Event, asyncio.Task[None]]:
    """Start generating in a thread of its own: the queue its events arrive on (the prompt's
    size, each chunk, the end or the error), the event that stops it between chunks, and the
    task that waits for it (cancel it when the caller stops listening)."""
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()

    def post(kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    def work() -> None:
        with loaded.lock:
            try:
                # Tokenized under the lock: one llama.cpp model, one caller at a time.
                tokens = loaded.llama.tokenize(prompt.encode("utf-8"), special=True)
                post("prompt", len(tokens))
                if len(tokens) + max_tokens > loaded.n_ctx:
                    return
                for chunk in loaded.llama.create_completion(tokens, stream=True, **args):
                    if cancel.is_set():
                        break
                    post("chunk", chunk)
                post("end", None)
            except Exception as exc:  # delivered to the caller, typed there
                post("error", exc)

    return events, cancel, loop.create_task(run_in_thread(work))


class LocalModel(ChatModel):
    """SmolLM2-135M-Instruct running in-process (llama.cpp), no network.

    Args:
        name: the bundled model (only ``smollm2``).
        model_path: a GGUF file to use instead of the bundled one (ChatML template expected).
        n_ctx: context size to allocate (default: the model's window, 8192).
        n_threads: CPU threads (default: half the cores, at least one; more threads than free
            cores make llama.cpp's spinning workers much slower on a busy machine).
        constrain_tool_calls: with tools offered, generate under a grammar: the reply is
            either one well-formed call naming a real tool with arguments valid for its schema,
            or the answer (free text, or JSON of ``json_schema``). A model this small writes
            broken calls otherwise. False leaves every reply with tools offered unconstrained,
            ``tool_choice="required"`` included (``keel bench models`` compares the two).
        repeat_penalty: llama.cpp's penalty on repeated tokens, for replies that may be prose.
            Greedy decoding of a model this small otherwise loops (it recites its tool list
            until ``max_tokens`` and the reply is cut); replies constrained to JSON (a required
            call, ``json_schema``, ``json_mode``) are not penalized. 1.0 turns it off.
        max_answer_tokens: the most tokens one answer takes, whatever a call's ``max_tokens``
            asks (default `DEFAULT_MAX_ANSWER_TOKENS`; ``resolve_model`` passes the
            ``local_max_answer_tokens`` setting, or the spec's ``?max_answer_tokens=N``). An
            agent's answer cut there ends as written, reported cut, and is not continued.
    """

    def __init__(
        self,
        name: str = "smollm2",
        *,
        model_path: str | Path | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        constrain_tool_calls: bool = True,
        repeat_penalty: float = 1.2,
        max_answer_tokens: int | None = None,
    ) -> None:
        if name != "smollm2":
            raise UnknownModelError(f"local:{name}", "bundled local models: smollm2")
        counter = counter_for(f"local:{name}")
        super().__init__(f"local:{name}", counter.profile, counter)
        self._path = Path(model_path) if model_path is not None else None
        self.n_ctx = n_ctx or counter.profile.context_window
        self.n_threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        self.constrain_tool_calls = constrain_tool_calls
        if repeat_penalty < 1.0:
            raise UsageError(f"repeat_penalty must be >= 1.0, got {repeat_penalty}")
        self.repeat_penalty = repeat_penalty
        cap = DEFAULT_MAX_ANSWER_TOKENS if max_answer_tokens is None else max_answer_tokens
        if cap < 1:
            raise UsageError(f"max_answer_tokens must be at least 1, got {cap}")
        self.max_answer_tokens: int = cap

    @property
    def context_window(self) -> int:
        """Tokens the loaded context holds, prompt plus answer."""
        return min(self.n_ctx, self.profile.context_window)

    def _model_path(self) -> Path:
        if self._path is not None:
            return self._path
        return smollm2_gguf()  # ModelNotInstalledError names `keel models install`

    def load(self) -> float:
        """Load the weights now (they load on first use otherwise); returns the load seconds."""
        return _load(self._model_path(), self.n_ctx, self.n_threads).load_s

    # --- prompt -------------------------------------------------------------------------------

    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] = (),
        options: ModelOptions | None = None,
    ) -> str:
        """The exact ChatML text the model reads for this request."""
        options = options or ModelOptions()
        offered = tools if options.tool_choice != "none" else ()
        parts: list[str] = []
        rest = list(messages)
        system = DEFAULT_SYSTEM
        if rest and rest[0].role == "system":
            system = rest.pop(0).content
        if offered:
            system = f"{system}\n\n{render_tools_prompt(offered)}"
        parts.append(f"<|im_start|>system\n{system}{_END}\n")
        for message in rest:
            role = message.role
            body = message.content
            if message.role == "assistant" and message.tool_calls:
                calls = "\n".join(render_tool_call(call) for call in message.tool_calls)
                body = f"{body}\n{calls}" if body else calls
            elif message.role == "tool":
                # The chat template has no tool role: results come back as the user's turn.
                role = "user"
                name = f" name={json.dumps(message.name)}" if message.name else ""
                body = f"<tool_response{name}>\n{message.content}\n</tool_response>"
            parts.append(f"<|im_start|>{role}\n{body}{_END}\n")
        parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    # --- generation ---------------------------------------------------------------------------

    def _answer_limit(self, options: ModelOptions) -> int:
        """The tokens this call may generate: the call's ``max_tokens``, within the cap."""
        asked = options.max_tokens
        return self.max_answer_tokens if asked is None else min(asked, self.max_answer_tokens)

    def _generation_args(
        self, tools: Sequence[ToolSchema], options: ModelOptions
    ) -> dict[str, Any]:
        args: dict[str, Any] = {
            "max_tokens": self._answer_limit(options),
            "temperature": 0.0 if options.temperature is None else options.temperature,
            "stop": [_END, "<|im_start|>", *options.stop],
        }
        structured = (
            options.tool_choice == "required"
            or options.json_schema is not None
            or options.json_mode
        )
        # JSON repeats its quotes, colons and keys by nature: only prose is penalized.
        args["repeat_penalty"] = 1.0 if structured else self.repeat_penalty
        if options.seed is not None:
            args["seed"] = options.seed
        if tools and self.constrain_tool_calls:
            args["grammar"] = _call_grammar(
                tools, options.json_schema, options.tool_choice == "required"
            )
        elif options.json_schema is not None:
            args["grammar"] = _grammar(options.json_schema)
        elif options.json_mode:
            args["grammar"] = _grammar(None)
        return args

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        path = self._model_path()
        loaded = _loaded.get((str(path), self.n_ctx, self.n_threads))  # loaded: no hop
        if loaded is None:
            loaded = await run_blocking(_load, path, self.n_ctx, self.n_threads)
        prompt = self.render_prompt(messages, tools, options)
        max_tokens = self._answer_limit(options)
        args = self._generation_args(tools if options.tool_choice != "none" else (), options)
        events, cancel, generating = _generate_in_thread(loop, loaded, prompt, max_tokens, args)
        answer = StreamedAnswer(started)
        prompt_tokens = 0
        finish: str | None = None
        # With tools offered, the text may be a call: it is parsed once it is whole.
        stream_text = not tools or options.tool_choice == "none"
        deadline = None if options.timeout_s is None else time.monotonic() + options.timeout_s
        try:
            while True:
                kind, value = await self._next_event(events, deadline, options)
                if kind == "end":
                    break
                if kind == "prompt":
                    prompt_tokens = value
                    if prompt_tokens + max_tokens > loaded.n_ctx:
                        raise ContextLengthExceededError(
                            f"the prompt is {prompt_tokens} tokens and {max_tokens} are "
                            f"reserved for the answer; the local model holds {loaded.n_ctx}",
                            model=self.spec,
                        )
                    continue
                choice = value["choices"][0]
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                out = answer.add(choice.get("text") or "")
                if out is not None and stream_text:
                    yield out
        finally:
            cancel.set()  # the thread stops at its next chunk, the lock then free
            generating.cancel()  # nobody waits for it any more
        completion = self._finish(
            answer.text, finish, prompt_tokens, tools, options, started, answer.ttft_ms
        )
        if not stream_text and completion.message.content:
            yield CompletionChunk(text=completion.message.content)
        if completion.message.tool_calls:
            yield CompletionChunk(tool_calls=whole_call_deltas(completion.message.tool_calls))
        yield CompletionChunk(completion=completion)

    async def _next_event(
        self,
        events: asyncio.Queue[tuple[str, Any]],
        deadline: float | None,
        options: ModelOptions,
    ) -> tuple[str, Any]:
        """The generation thread's next event (``prompt``, ``chunk`` or ``end``), by the
        call's deadline; its failure raised as keel's error."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            kind, value = await asyncio.wait_for(events.get(), timeout)
        except TimeoutError as exc:
            raise ModelTimeoutError(
                f"no complete answer within {options.timeout_s}s", model=self.spec
            ) from exc
        if kind == "error":
            raise ModelUnavailableError(
                f"local generation failed: {type(value).__name__}: {value}", model=self.spec
            ) from value
        return kind, value

    def _finish(
        self,
        text: str,
        finish: str | None,
        prompt_tokens: int,
        tools: Sequence[ToolSchema],
        options: ModelOptions,
        started: float,
        ttft: float | None,
    ) -> Completion:
        completion_tokens = self.counter.tokenizer.count(text)
        offered = tools if options.tool_choice != "none" else ()
        parsed = parse_tool_calls(text, offered) if offered else None
        if parsed is not None and (parsed.calls or parsed.errors):
            message = Message.assistant(parsed.text, tool_calls=parsed.calls)
            errors = parsed.errors
        else:
            message = Message.assistant(text.strip())
            errors = ()
        reason: FinishReason = "length" if finish == "length" else "stop"
        if message.tool_calls and reason == "stop":
            reason = "tool_calls"
        completion = Completion(
            message=message,
            finish_reason=reason,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            model=self.spec,
            latency_ms=(time.perf_counter() - started) * 1000,
            ttft_ms=ttft,
            raw={"text": text, "finish_reason": finish},
            tool_call_errors=errors,
        )
        refuse_cut_answer(
            completion, options, self.spec, f"max_tokens={self._answer_limit(options)}"
        )
        return completion

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        final: Completion | None = None
        async for chunk in self._astream(messages, tools, options):
            if chunk.completion is not None:
                final = chunk.completion
        assert final is not None  # _astream always ends with the completion or raises
        return final
