"""``keel bench stream``: streaming against a real OpenAI-compatible server, and its invariants.

The bench starts llama-cpp-python's own server with the bundled SmolLM2 on 127.0.0.1, then:

* **Latency.** The same prompts three ways, back to back, greedy: the official ``openai`` SDK
  streaming straight from the server, ``agent.stream`` and ``agent.run`` (a fresh session each,
  so every way sends the model the same two messages and gets the same tokens). Time to the
  first text: the SDK's first content delta, the agent's first ``TextDelta`` (its lease, state,
  checkpoint and prompt included, and the word its masking waits for). keel's added latency is
  the per-prompt difference. A second agent without masking shows what the masking costs.
* **Chaos.** Streamed turns on one session through a loopback proxy that cuts the server's
  reply mid-stream at random (a real TCP close), while the consumer stops iterating at random.
  After every turn the committed state is checked against what the stream showed: each user
  message stored once, no reply text that was never finished, every completed turn's reply the
  text its deltas added up to, a stopped turn left open at its last checkpoint and finished by
  the next one, and no model request still running once its consumer stopped.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.bench._stats import nearest_rank
from keel.models import ModelOptions, OpenAICompatibleModel, RetryPolicy
from keel.privacy import PIIMasker, StreamMasker
from keel.runtime import (
    Agent,
    AgentReply,
    CheckpointCommitted,
    TextDelta,
    TextDiscarded,
    TurnFinished,
)
from keel.settings import load_settings
from keel.state import AgentState
from keel.testing.servers import llama_server

__all__ = ["run_stream_bench"]

_SYSTEM = "You are a concise assistant. Answer in one or two sentences."
_QUESTIONS = (
    "What is the capital of France?",
    "Name a primary colour.",
    "Why is the sky blue?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is water made of?",
    "Which planet is the largest?",
    "What is the opposite of hot?",
    "Say something about the sea.",
    "What is a noun?",
)


class _LoopbackProxy:
    """A loopback TCP proxy to the model server; subclasses watch, and may cut, what passes.

    Each client connection gets its own upstream connection. The hooks run on the proxy's
    event loop with the connection's id: a request starting, a piece of the reply on its way
    back (a number returned cuts the connection after that many of its bytes: a real TCP
    close in the middle of the SSE stream), and the connection ending."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _on_request(self, connection: int) -> None:
        """A request's first bytes are on their way to the server."""

    def _on_reply(self, connection: int, data: bytes) -> int | None:
        """``data`` of the server's reply is on its way back; a number cuts it after that many
        bytes and closes the connection."""
        return None

    def _on_close(self, connection: int) -> None:
        """The connection ended, either side having closed it."""

    async def _serve(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        upstream_in, upstream_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        connection = id(client_out)

        async def pump_requests() -> None:
            with suppress(ConnectionError, asyncio.CancelledError):
                while data := await client_in.read(65536):
                    if data.startswith(b"POST"):
                        self._on_request(connection)
                    upstream_out.write(data)
                    await upstream_out.drain()
            upstream_out.close()

        async def pump_replies() -> None:
            with suppress(ConnectionError, asyncio.CancelledError):
                while data := await upstream_in.read(65536):
                    cut = self._on_reply(connection, data)
                    if cut is not None:
                        client_out.write(data[:cut])
                        break
                    client_out.write(data)
                    await client_out.drain()
            client_out.close()
            upstream_out.close()

        requests = asyncio.create_task(pump_requests())
        try:
            await pump_replies()
        finally:
            requests.cancel()
            with suppress(asyncio.CancelledError):
                await requests
            self._on_close(connection)


class _CuttingProxy(_LoopbackProxy):
    """A proxy that can cut a reply mid-stream.

    ``cut_next(after_bytes)`` makes the next response forwarded close both sockets after that
    many bytes of it: the client sees the connection drop in the middle of the SSE stream.
    ``replying`` counts the connections whose request is still being answered: one the client
    gave up on ends when the client closes its side, which closes the server's too."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._replying: set[int] = set()
        self._cut_after: int | None = None
        # Per connection: the byte its reply is cut after (None: not cut), bytes forwarded.
        self._limits: dict[int, tuple[int | None, int]] = {}
        self.cuts = 0

    def cut_next(self, after_bytes: int) -> None:
        self._cut_after = after_bytes

    @property
    def replying(self) -> int:
        return len(self._replying)

    def _on_request(self, connection: int) -> None:
        self._replying.add(connection)
        self._limits[connection], self._cut_after = (self._cut_after, 0), None

    def _on_reply(self, connection: int, data: bytes) -> int | None:
        limit, forwarded = self._limits.get(connection, (None, 0))
        if limit is not None and forwarded + len(data) > limit:
            self.cuts += 1
            return max(0, limit - forwarded)
        self._limits[connection] = (limit, forwarded + len(data))
        if b"[DONE]" in data:
            self._replying.discard(connection)
            self._limits[connection] = (None, 0)
        return None

    def _on_close(self, connection: int) -> None:
        self._replying.discard(connection)
        self._limits.pop(connection, None)


class _WireClock(_LoopbackProxy):
    """A proxy, on a thread and event loop of its own, that timestamps the wire.

    For each request it records when its first byte reached the proxy and when the first SSE
    chunk with text went back through it (``time.perf_counter``, the client's clock). The time
    a caller takes before its request is on the wire, plus the time from the first text on the
    wire to the caller's first shown text, is the caller's own share of its time to first
    token: the server's prompt processing, which varies by tens of ms from one request to the
    next, is not in it. Its own thread keeps the caller's work from delaying the timestamps.
    """

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.requests: list[list[float]] = []
        # Per connection: its request's record, and the reply's bytes after its last newline.
        self._current: dict[int, list[float]] = {}
        self._partial: dict[int, bytes] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> _WireClock:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop_serving(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop_serving(self) -> None:
        # The connections still open (kept alive by the clients): the loop is this proxy's own.
        serving = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await self.stop()

    def mark(self) -> int:
        """Where the next request will be in `requests`."""
        return len(self.requests)

    def first_since(self, mark: int) -> tuple[float, float]:
        """The first request since ``mark``: (its first byte in, its first text out). A turn
        can send more than one (a reply cut at ``max_tokens`` is continued): its first text
        came from the first."""
        request, text = self.requests[mark]
        return request, text

    def _on_request(self, connection: int) -> None:
        record = [time.perf_counter(), math.nan]
        self.requests.append(record)
        self._current[connection] = record
        self._partial[connection] = b""

    def _on_reply(self, connection: int, data: bytes) -> int | None:
        seen = time.perf_counter()
        record = self._current.get(connection)
        if record is not None and math.isnan(record[1]):
            *lines, self._partial[connection] = (self._partial[connection] + data).split(b"\n")
            if any(_has_text(line) for line in lines):
                record[1] = seen
        return None

    def _on_close(self, connection: int) -> None:
        self._current.pop(connection, None)
        self._partial.pop(connection, None)


def _has_text(line: bytes) -> bool:
    """Whether one SSE line is a chat completion chunk carrying text."""
    if not line.startswith(b"data: {"):
        return False
    try:
        chunk = json.loads(line[6:])
        return bool(chunk["choices"][0]["delta"].get("content"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False


def _agent(base_url: str, folder: Path, max_tokens: int, *, masked: bool, name: str) -> Any:
    model = OpenAICompatibleModel(
        "smollm2",
        base_url=base_url,
        api_key="local",
        retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.1),
    )
    options: dict[str, Any] = {} if masked else {"masker": None}
    return Agent.embedded(
        model,
        system_prompt=_SYSTEM,
        memory=False,
        settings=load_settings(data_dir=folder / name, embedder="hashing:64"),
        model_options=ModelOptions(max_tokens=max_tokens, temperature=0),
        name=name,
        **options,
    )


@dataclass(frozen=True)
class _FirstText:
    """One streamed call's clock: when it started and when it first showed text (masked, for
    the SDK's ``masked``, as the agent masks), and where the wire saw its request and text."""

    started: float
    shown: float
    wire_request: float
    wire_text: float
    masked: float = math.nan

    def ttft_ms(self, *, masked: bool = False) -> float:
        return ((self.masked if masked else self.shown) - self.started) * 1000

    def own_ms(self, *, masked: bool = False) -> float:
        """The caller's share of its time to first text: before its request reached the
        wire, and after the wire's first text."""
        shown = self.masked if masked else self.shown
        return ((self.wire_request - self.started) + (shown - self.wire_text)) * 1000


async def _sdk_turn(
    client: Any, clock: _WireClock, question: str, max_tokens: int, policy: PIIMasker
) -> tuple[_FirstText, int, float]:
    """The raw SDK: its first content delta, and the first text the SDK's caller could show
    if it masked as the agent does (keel's StreamMasker over the same deltas, with ``policy``,
    the agent's own); tokens; decode seconds."""
    masker = StreamMasker(
        lambda whole: policy.mask_text(whole, remember=False),
        by_word=policy.streams_by_word(),
        spans=policy.mask_spans,
    )
    mark = clock.mark()
    started = time.perf_counter()
    first: float | None = None
    first_masked: float | None = None
    pieces = 0
    stream = await client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "system", "content": _SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if first is None:
                first = time.perf_counter()
            if first_masked is None and masker.feed(chunk.choices[0].delta.content):
                first_masked = time.perf_counter()
    ended = time.perf_counter()
    assert first is not None, "the server streamed no text"
    if first_masked is None and masker.finish():
        first_masked = ended
    if first_masked is None:
        first_masked = first  # masked to nothing: no first text, the raw figure stands in
    request, text = clock.first_since(mark)
    return _FirstText(started, first, request, text, first_masked), pieces, ended - first


async def _bust_cache(client: Any) -> None:
    """One token for an unrelated prompt (no system message), so the next request shares no
    cached prefix with the previous one."""
    await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )


async def _agent_stream_ttft(
    agent: Any, clock: _WireClock, session: str, question: str
) -> _FirstText:
    mark = clock.mark()
    started = time.perf_counter()
    first: float | None = None
    async for event in agent.stream(question, session=session, user="bench"):
        if first is None and isinstance(event, TextDelta):
            first = time.perf_counter()
    assert first is not None, "the agent streamed no text"
    request, text = clock.first_since(mark)
    return _FirstText(started, first, request, text)


def _percentiles(name: str, values: list[float]) -> dict[str, float]:
    return {
        f"{name}_p50": round(nearest_rank(values, 0.5), 2),
        f"{name}_p95": round(nearest_rank(values, 0.95), 2),
    }


async def _latency(
    base_url: str, folder: Path, turns: int, max_tokens: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    from openai import AsyncOpenAI

    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    with _WireClock(port) as clock:
        wired = f"http://127.0.0.1:{clock.port}/v1"
        client = AsyncOpenAI(base_url=wired, api_key="local")
        masked = _agent(wired, folder, max_tokens, masked=True, name="masked")
        plain = _agent(wired, folder, max_tokens, masked=False, name="unmasked")
        try:
            return await _latency_ways(client, clock, masked, plain, turns, max_tokens, progress)
        finally:
            await masked.aclose()
            await plain.aclose()
            await client.close()


async def _latency_ways(
    client: Any,
    clock: _WireClock,
    masked: Any,
    plain: Any,
    turns: int,
    max_tokens: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    policy = masked.masker
    assert policy is not None, "the masked agent has no masker"
    sdk: list[_FirstText] = []
    streamed: list[_FirstText] = []
    unmasked: list[_FirstText] = []
    run_ms: list[float] = []
    rates: list[float] = []
    # One warm-up of each path (connections, the server's first prompt).
    await _sdk_turn(client, clock, "Hello", max_tokens, policy)
    await _agent_stream_ttft(masked, clock, "warm", "Hello")
    await _agent_stream_ttft(plain, clock, "warm", "Hello")
    for turn in range(turns):
        question = _QUESTIONS[turn % len(_QUESTIONS)]

        async def sdk_way(question: str = question) -> None:
            first, pieces, decode_s = await _sdk_turn(client, clock, question, max_tokens, policy)
            sdk.append(first)
            if pieces > 1 and decode_s > 0:
                rates.append((pieces - 1) / decode_s)

        async def stream_way(question: str = question, turn: int = turn) -> None:
            streamed.append(await _agent_stream_ttft(masked, clock, f"s{turn}", question))

        async def unmasked_way(question: str = question, turn: int = turn) -> None:
            unmasked.append(await _agent_stream_ttft(plain, clock, f"s{turn}", question))

        async def run_way(question: str = question, turn: int = turn) -> None:
            started = time.perf_counter()
            await masked.run(question, session=f"r{turn}", user="bench")
            run_ms.append((time.perf_counter() - started) * 1000)

        ways = [sdk_way, stream_way, unmasked_way, run_way]
        # Rotated, and each after an unrelated prompt: the server keeps the previous
        # prompt's cache, which would make whichever way came second look faster.
        ways = ways[turn % len(ways) :] + ways[: turn % len(ways)]
        for way in ways:
            await _bust_cache(client)
            await way()
        if (turn + 1) % 10 == 0:
            progress(f"latency: {turn + 1}/{turns} prompts")
    return _latency_figures(turns, sdk, streamed, unmasked, run_ms, rates)


def _latency_figures(
    turns: int,
    sdk: list[_FirstText],
    streamed: list[_FirstText],
    unmasked: list[_FirstText],
    run_ms: list[float],
    rates: list[float],
) -> dict[str, Any]:
    pairs = list(zip(sdk, streamed, unmasked, strict=True))
    return {
        "latency_turns": turns,
        "ttft_ms_p50": {
            "sdk": round(nearest_rank([s.ttft_ms() for s in sdk], 0.5), 2),
            "sdk_masked": round(nearest_rank([s.ttft_ms(masked=True) for s in sdk], 0.5), 2),
            "agent_stream": round(nearest_rank([a.ttft_ms() for a in streamed], 0.5), 2),
            "agent_stream_unmasked": round(nearest_rank([a.ttft_ms() for a in unmasked], 0.5), 2),
        },
        **_percentiles("added_ttft_ms", [a.ttft_ms() - s.ttft_ms() for s, a, _ in pairs]),
        **_percentiles("added_ttft_ms_unmasked", [u.ttft_ms() - s.ttft_ms() for s, _, u in pairs]),
        # agent.stream against the SDK's caller masking the same deltas the same way: what
        # keel adds besides the word that masking must wait for, whoever masks.
        **_percentiles(
            "added_ttft_ms_vs_masked_sdk",
            [a.ttft_ms() - s.ttft_ms(masked=True) for s, a, _ in pairs],
        ),
        # The same differences of the callers' own shares (see _WireClock): the server's
        # time, the same work for both, is left out with its request-to-request jitter.
        "wire": {
            **_percentiles("added_ttft_ms", [a.own_ms() - s.own_ms() for s, a, _ in pairs]),
            **_percentiles(
                "added_ttft_ms_unmasked", [u.own_ms() - s.own_ms() for s, _, u in pairs]
            ),
            **_percentiles(
                "added_ttft_ms_vs_masked_sdk",
                [a.own_ms() - s.own_ms(masked=True) for s, a, _ in pairs],
            ),
        },
        "agent_run_ms_p50": round(nearest_rank(run_ms, 0.5), 2),
        "tokens_per_s": round(statistics.median(rates), 1) if rates else 0.0,
    }


class _ChaosRun:
    """Streamed turns on one session through the cutting proxy, each checked against the
    committed state."""

    def __init__(self, agent: Any, proxy: _CuttingProxy) -> None:
        self.agent = agent
        self.proxy = proxy
        self.violations: list[str] = []
        self.cancellations = 0
        self.completed = 0
        self.sent: list[str] = []

    async def turn(self, turn: int, text: str, stop_after: int | None) -> None:
        self.sent.append(text)
        shown, reply = await self._stream(turn, text, stop_after)
        state = self.agent.session_state("chaos")
        if state is None:
            self.violations.append(f"turn {turn}: no state")
            return
        users = [m.content for m in state.messages if m.role == "user"]
        if reply is None:
            self.cancellations += 1
            await self._check_stopped(turn, state, shown)
        else:
            self.completed += 1
            self._check_finished(turn, state, shown, reply)
        # Every message sent is stored exactly once (a stopped turn's is kept, open).
        if sorted(users) != sorted(self.sent):
            self.violations.append(f"turn {turn}: user messages lost or repeated")

    async def _stream(
        self, turn: int, text: str, stop_after: int | None
    ) -> tuple[list[str], AgentReply | None]:
        """The text the stream showed (what a TextDiscarded took back removed) and its reply,
        None when the consumer stopped first."""
        shown: list[str] = []
        checkpoints = deltas = 0
        reply = None
        stream = self.agent.stream(text, session="chaos", user="bench")
        try:
            async for event in stream:
                if isinstance(event, CheckpointCommitted):
                    checkpoints += 1
                elif isinstance(event, TextDiscarded):
                    shown.clear()
                elif isinstance(event, TextDelta):
                    if not checkpoints:
                        self.violations.append(f"turn {turn}: text before any checkpoint")
                    shown.append(event.text)
                    deltas += 1
                    if stop_after is not None and deltas >= stop_after:
                        break
                elif isinstance(event, TurnFinished):
                    reply = event.reply
        finally:
            await stream.aclose()
        return shown, reply

    async def _check_stopped(self, turn: int, state: AgentState, shown: list[str]) -> None:
        # Stopped mid-stream: the turn is open at a checkpoint before a model call, or,
        # when it had finished before the stop reached it, committed whole (the text
        # shown is the start of its reply).
        head = self.agent.state.history(self.agent.session_key("chaos"), limit=1)[0]
        if state.runtime.open_turn is not None:
            if head.reason != "before model call":
                self.violations.append(f"turn {turn}: left open at a {head.reason!r} write")
        else:
            assistants = [m.content for m in state.messages if m.role == "assistant"]
            if not assistants or not assistants[-1].startswith("".join(shown)):
                self.violations.append(f"turn {turn}: committed text is not what streamed")
        await asyncio.sleep(0.3)
        if self.proxy.replying > 0:
            self.violations.append(f"turn {turn}: the model request kept running")

    def _check_finished(
        self, turn: int, state: AgentState, shown: list[str], reply: AgentReply
    ) -> None:
        if reply.status == "completed" and "".join(shown) != reply.text:
            self.violations.append(f"turn {turn}: streamed text differs from the reply")
        if state.runtime.open_turn is not None:
            self.violations.append(f"turn {turn}: a finished turn was left open")
        assistants = [m.content for m in state.messages if m.role == "assistant"]
        if reply.status == "completed" and (not assistants or assistants[-1] != reply.text):
            self.violations.append(f"turn {turn}: the committed reply is not the streamed one")


async def _chaos(
    base_url: str,
    folder: Path,
    turns: int,
    max_tokens: int,
    seed: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    proxy = _CuttingProxy(port)
    await proxy.start()
    agent = _agent(
        f"http://127.0.0.1:{proxy.port}/v1", folder, max_tokens, masked=True, name="chaos"
    )
    rng = random.Random(seed)
    run = _ChaosRun(agent, proxy)
    try:
        for turn in range(turns):
            text = f"{_QUESTIONS[turn % len(_QUESTIONS)]} (turn {turn})"
            if rng.random() < 0.25:
                proxy.cut_next(rng.randint(200, 1200))
            stop_after = rng.randint(1, 6) if rng.random() < 0.25 else None
            await run.turn(turn, text, stop_after)
            if (turn + 1) % 20 == 0:
                progress(f"chaos: {turn + 1}/{turns} turns, {len(run.violations)} violations")
    finally:
        await agent.aclose()
        await proxy.stop()
    return {
        "turns": turns,
        "completed": run.completed,
        "cancellations": run.cancellations,
        "cuts": proxy.cuts,
        "violations": len(run.violations),
        "violation_examples": run.violations[:5],
        "seed": seed,
    }


def run_stream_bench(
    *,
    latency_turns: int = 30,
    chaos_turns: int = 200,
    max_tokens: int = 24,
    seed: int = 7,
    progress: Callable[[str], None] = lambda text: None,
) -> dict[str, Any]:
    """The whole ``keel bench stream`` report (one JSON object)."""
    folder = Path(tempfile.mkdtemp(prefix="keel-bench-stream-"))
    with llama_server(n_ctx=2048) as base_url:
        progress(f"llama.cpp server at {base_url}")
        latency = asyncio.run(_latency(base_url, folder, latency_turns, max_tokens, progress))
        chaos = asyncio.run(_chaos(base_url, folder, chaos_turns, max_tokens, seed, progress))
    return {
        "turns": chaos["turns"],
        **latency,
        "cancellations": chaos["cancellations"],
        "cuts": chaos["cuts"],
        "violations": chaos["violations"],
        "chaos": chaos,
        "max_tokens": max_tokens,
    }
