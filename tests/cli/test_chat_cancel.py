"""``keel chat`` as a person uses it, in a real process on a real terminal's signals: Ctrl-C
(SIGINT) in the middle of a story cancels it (the next question is answered on its own, the
story is never finished, the history says it was cancelled), and a chat reopened on a session
with history says so. The model is an OpenAI-compatible server in this test that streams the
story's first words and then waits: the order comes from what the chat prints, not sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.cli import keel_process

_STORY = "Once upon a time there was a keel. " * 6
"""Longer than what masking holds back from the end of a stream (64 characters)."""


class _StoryServer(ThreadingHTTPServer):
    """Streams ``Re: <question>``; the first story it is asked for stops after its first words
    and waits (a slow model) until the test ends."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.asked: list[list[dict[str, Any]]] = []
        self.story_started = False
        self.done = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: _StoryServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        messages = body["messages"]
        self.server.asked.append(messages)
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._send({"role": "assistant", "content": ""})
        if "story" in question and not self.server.story_started:
            self.server.story_started = True
            self._send({"content": _STORY})
            self.server.done.wait(120)  # the story would go on; Ctrl-C stops it here
            return
        self._send({"content": f"Re: {question}"})
        self._send({}, finish="stop")
        self._raw(b"data: [DONE]\n\n")
        self._raw(b"")

    def _send(self, delta: dict[str, Any], finish: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        payload = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
        self._raw(f"data: {json.dumps(payload)}\n\n".encode())

    def _raw(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def story_server() -> Iterator[_StoryServer]:
    server = _StoryServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.done.set()
        server.shutdown()
        server.server_close()


class _Screen:
    """What a running ``keel chat`` has printed so far, read as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.text = ""
        self._changed = threading.Condition()
        assert process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        while chunk := stream.read(1):
            with self._changed:
                self.text += chunk
                self._changed.notify_all()

    def finished(self) -> None:
        """Everything the chat printed, once it has exited."""
        self._reader.join(timeout=30)

    def wait_for(self, *any_of: str, after: int = 0) -> str:
        """The first of ``any_of`` the chat printed after position ``after``."""
        deadline = time.monotonic() + 90
        with self._changed:
            while True:
                for text in any_of:
                    if text in self.text[after:]:
                        return text
                left = deadline - time.monotonic()
                assert left > 0, f"the chat never printed any of {any_of}:\n{self.text}"
                self._changed.wait(left)


def _chat_process(*args: str) -> subprocess.Popen[str]:
    # Ctrl-C reaches the chat as at a terminal: a test run started in the background inherits
    # SIGINT ignored, and a child would then never see it.
    return subprocess.Popen(
        [sys.executable, "-m", "keel", "chat", "--no-memory", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KEEL_PII_VAULT": "off"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_ctrl_c_cancels_the_story_and_the_next_question_gets_its_own_answer(
    story_server: _StoryServer,
) -> None:
    model = f"openai-compatible:gpt-4o-mini@{story_server.base_url}"
    process = _chat_process("-m", model, "--session", "s1")
    assert process.stdin is not None
    screen = _Screen(process)
    try:
        process.stdin.write("Tell me a story\n")
        process.stdin.flush()
        screen.wait_for("Once upon a")
        process.send_signal(signal.SIGINT)
        said = screen.wait_for("(cancelled", "(turn interrupted")
        assert said == "(cancelled", screen.text
        mark = len(screen.text)
        process.stdin.write("What is two plus two?\n")
        process.stdin.flush()
        screen.wait_for("Re: What is two plus two?", after=mark)
        process.stdin.write("/state all\n")
        process.stdin.close()
        assert process.wait(timeout=90) == 0, process.stderr and process.stderr.read()
        screen.finished()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pipe in (process.stdout, process.stderr):
            assert pipe is not None
            pipe.close()
    shown = screen.text
    assert "finishing the interrupted turn" not in shown, shown
    # The model was asked the story once and then the new question, never to finish the story.
    questions = [
        next(m["content"] for m in reversed(asked) if m["role"] == "user")
        for asked in story_server.asked
    ]
    assert questions == ["Tell me a story", "What is two plus two?"], questions
    # It saw the story cancelled, in keel's words, before the new question.
    seen = [m["content"] for m in story_server.asked[1]]
    story_at = seen.index("Tell me a story")
    assert any("[cancelled]" in text for text in seen[story_at + 1 : -1]), seen
    # The history (/state all) says so too.
    state = shown[shown.index("Re: What is two plus two?") :]
    assert "[cancelled]" in state and "cancelled the turn above" in state, shown


def test_reopening_a_chat_with_history_says_it_resumes_it() -> None:
    first = keel_process(
        "chat", "--no-memory", "-m", "scripted:echo", "--session", "s7", stdin="hello\n"
    )
    assert first.returncode == 0, first.stderr
    assert "resuming session" not in first.stdout
    again = keel_process("chat", "--no-memory", "-m", "scripted:echo", "--session", "s7")
    assert again.returncode == 0, again.stderr
    head = " ".join(again.stdout.split())
    assert "resuming session s7: 2 messages so far; /state all shows them" in head, head
