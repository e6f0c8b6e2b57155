"""An OpenAI-compatible model server that decides like a support model, deterministically:
asked for a refund it looks the order up by the e-mail in the message, then calls
``issue_refund`` for the order's total, then says what the refund's result was; anything
else it answers ``Answer N: TEXT`` (N: the user messages it was sent, so a test sees whether
the conversation's earlier turns were kept). Non-streamed completions only."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["support_model_server"]


def _since_last_user(messages: list[dict[str, Any]]) -> tuple[str, list[str]]:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    # Tool results, and the runtime's notes (a decided call's outcome comes as one).
    results = [
        str(m.get("content") or "")
        for m in messages[last_user + 1 :]
        if m["role"] in ("tool", "system")
    ]
    return str(messages[last_user]["content"]), results


def _call(name: str, arguments: dict[str, Any], number: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{name}_{number}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def decide(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's message for ``messages``."""
    said, results = _since_last_user(messages)
    if "refund" not in said.lower():
        users = sum(1 for m in messages if m["role"] == "user")
        return {"role": "assistant", "content": f"Answer {users}: {said}"}
    if not results:
        # The e-mail as the model sees it: a placeholder of the PII vault, or the address.
        found = re.search(r"<EMAIL_\d+>|[\w.+-]+@[\w-]+\.[\w.]+", said)
        return _call("lookup_order", {"email_or_order_id": found.group(0) if found else ""}, 1)
    if len(results) == 1 and results[0].startswith("["):
        order = json.loads(results[0])[0]
        arguments = {"order_id": order["id"], "amount": order["total"], "reason": "damaged"}
        return _call("issue_refund", arguments, 2)
    ran = [found.group(0) for r in results if (found := re.search(r"refunded .*", r))]
    return {"role": "assistant", "content": f"Done: {ran[-1]}." if ran else "Not refunded."}


@contextmanager
def support_model_server() -> Iterator[str]:
    """The server on a free loopback port; yields its base URL (``.../v1``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            message = decide(request["messages"])
            body = json.dumps(
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": request.get("model", "support"),
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
