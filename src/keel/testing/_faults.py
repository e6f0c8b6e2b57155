"""A local OpenAI-compatible server that fails on purpose, to test fault handling for real.

Point [`OpenAICompatibleModel`][] at ``server.base_url`` and pick the fault with
the request's model name, ``SCENARIO[:N][#TAG]``:

=====================  ==========================================================================
``ok``                 a normal answer (streamed when asked)
``rate_limit:N``       429 with ``Retry-After`` for the first N requests, then ok (N omitted:
                       always 429)
``server_error:N``     500 for the first N requests, then ok (N omitted: always 500)
``hang``               accepts the request and never answers (until the server stops)
``cut_stream``         streams a few chunks, then drops the connection (no finish, no [DONE]);
                       without streaming, sends half a body and drops the connection
``cut_early:N``        for the first N requests, drops the connection right after the headers
                       (before any chunk), then ok
``malformed_tool_args``  a tool call whose arguments are not valid JSON
``length``             an answer cut by max_tokens (``finish_reason: "length"``)
``context_length``     400 ``context_length_exceeded``
``unauthorized``       401 ``invalid_api_key``
=====================  ==========================================================================

Counters are kept per full model string, so ``server_error:2#a`` and ``server_error:2#b``
fail independently. Every request is recorded in `FaultServer.requests`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["FAULT_SCENARIOS", "FaultRequest", "FaultServer"]

FAULT_SCENARIOS = (
    "ok",
    "rate_limit",
    "server_error",
    "hang",
    "cut_stream",
    "cut_early",
    "malformed_tool_args",
    "length",
    "context_length",
    "unauthorized",
)
"""The scenario names a request's model may start with."""

_TEXT = "Hello from the fault server."


@dataclass(frozen=True)
class FaultRequest:
    """One request the server received."""

    model: str
    stream: bool
    at: float
    body: dict[str, Any]


def _parse(model: str) -> tuple[str, int | None]:
    scenario = model.split("#", 1)[0]
    name, _, count = scenario.partition(":")
    return name, int(count) if count.isdigit() else None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request log lines."""

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str, kind: str) -> None:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        headers = {}
        if status == 429:
            after = self.server.owner.retry_after_s
            headers = {"Retry-After": f"{after:g}", "retry-after-ms": str(int(after * 1000))}
        self._json(status, body, headers)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._error(400, "the body is not JSON", "invalid_json", "invalid_request_error")
            return
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._error(404, f"no route {self.path}", "not_found", "invalid_request_error")
            return
        model = str(body.get("model", "ok"))
        stream = bool(body.get("stream"))
        owner = self.server.owner
        seen = owner._record(FaultRequest(model, stream, time.monotonic(), body))
        name, count = _parse(model)
        failing = count is None or seen <= count
        if name == "rate_limit" and failing:
            self._error(429, "Rate limit reached, retry later", "rate_limit_exceeded", "requests")
        elif name == "server_error" and failing:
            self._error(500, "The server had an error", "server_error", "server_error")
        elif name == "unauthorized":
            self._error(
                401, "Incorrect API key provided", "invalid_api_key", "invalid_request_error"
            )
        elif name == "context_length":
            self._error(
                400,
                "This model's maximum context length is 8192 tokens. However, your messages "
                "resulted in 9001 tokens. Please reduce the length of the messages.",
                "context_length_exceeded",
                "invalid_request_error",
            )
        elif name == "hang":
            owner._stopping.wait(owner.hang_s)
            with contextlib.suppress(OSError):
                self._json(200, self._completion(model, _TEXT, "stop"))
        elif name == "cut_stream":
            self._cut(model, stream)
        elif name == "cut_early" and failing:
            self._cut(model, stream, early=True)
        elif name == "malformed_tool_args":
            call = {
                "id": "call_bad",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Par'},
            }
            self._answer(model, stream, "", "tool_calls", [call])
        elif name == "length":
            self._answer(model, stream, "Hello from the fault ser", "length")
        elif name in ("ok", "rate_limit", "server_error", "cut_early"):
            self._answer(model, stream, _TEXT, "stop")
        else:
            self._error(
                404, f"unknown scenario {model!r}", "model_not_found", "invalid_request_error"
            )

    @staticmethod
    def _completion(
        model: str, text: str, finish: str, calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return {
            "id": "chatcmpl-fault",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
        }

    def _chunk(self, model: str, delta: dict[str, Any], finish: str | None) -> bytes:
        payload = {
            "id": "chatcmpl-fault",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(payload)}\n\n".encode()

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _answer(
        self,
        model: str,
        stream: bool,
        text: str,
        finish: str,
        calls: list[dict[str, Any]] | None = None,
    ) -> None:
        if not stream:
            self._json(200, self._completion(model, text, finish, calls))
            return
        self._start_stream()
        self._send(self._chunk(model, {"role": "assistant", "content": ""}, None))
        words = text.split(" ") if text else []
        for index, word in enumerate(words):
            piece = word if index == len(words) - 1 else word + " "
            self._send(self._chunk(model, {"content": piece}, None))
        for index, call in enumerate(calls or ()):
            arguments = call["function"]["arguments"]
            head: dict[str, Any] = {"index": index, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            self._send(self._chunk(model, {"tool_calls": [head]}, None))
            for start in range(0, len(arguments), 5):
                part = {"index": index, "function": {"arguments": arguments[start : start + 5]}}
                self._send(self._chunk(model, {"tool_calls": [part]}, None))
        self._send(self._chunk(model, {}, finish))
        usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
        last = {"id": "chatcmpl-fault", "object": "chat.completion.chunk", "model": model}
        self._send(f"data: {json.dumps({**last, 'choices': [], 'usage': usage})}\n\n".encode())
        self._send(b"data: [DONE]\n\n")
        self._send(b"")

    def _cut(self, model: str, stream: bool, *, early: bool = False) -> None:
        if stream:
            self._start_stream()
            if not early:
                self._send(self._chunk(model, {"role": "assistant", "content": ""}, None))
                for word in ("Hello", "from", "the"):
                    self._send(self._chunk(model, {"content": word + " "}, None))
        else:
            data = json.dumps(self._completion(model, _TEXT, "stop")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
        # Drop the connection without finishing the body: what a crashed proxy does.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultServer


class FaultServer:
    """An OpenAI-compatible HTTP server on 127.0.0.1 that produces the faults it is asked for.

    Use it as a context manager (or call [`start`][] / [`stop`][]):

    ```python
    with FaultServer(retry_after_s=0.2) as server:
        model = OpenAICompatibleModel("rate_limit:2", base_url=server.base_url, api_key="x")
    ```

    Args:
        retry_after_s: the ``Retry-After`` a 429 carries.
        hang_s: how long a ``hang`` request waits before answering (stopping the server ends
            the wait at once).
    """

    def __init__(self, *, retry_after_s: float = 0.2, hang_s: float = 30.0) -> None:
        self.retry_after_s = retry_after_s
        self.hang_s = hang_s
        self.requests: list[FaultRequest] = []
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def _record(self, request: FaultRequest) -> int:
        with self._lock:
            self.requests.append(request)
            self._counts[request.model] = self._counts.get(request.model, 0) + 1
            return self._counts[request.model]

    def count(self, model: str) -> int:
        """Requests received for one model string."""
        with self._lock:
            return self._counts.get(model, 0)

    @property
    def base_url(self) -> str:
        """The API root to give a client: ``http://127.0.0.1:PORT/v1``."""
        if self._server is None:
            raise RuntimeError("the fault server is not running")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> FaultServer:
        """Start serving on a free loopback port, in a background thread."""
        self._stopping.clear()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release hanging requests."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
