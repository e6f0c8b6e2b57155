"""Real parts for the model tests: llama.cpp's own OpenAI server, the fault server, SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keel._assets import smollm2_gguf
from keel.models import LocalModel, RetryPolicy
from keel.testing import FaultServer
from keel.testing.servers import free_port

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_flight",
            "description": "Book a flight",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination"],
            },
        },
    },
]


@pytest.fixture
def fast_retry() -> RetryPolicy:
    """A retry policy with short waits, so fault tests take fractions of a second."""
    return RetryPolicy(
        max_attempts=3,
        initial_backoff_s=0.05,
        max_backoff_s=0.2,
        attempt_timeout_s=2.0,
        max_total_s=10,
    )


@pytest.fixture
def hang_retry(fast_retry: RetryPolicy) -> RetryPolicy:
    """``fast_retry`` with a 0.5 s limit per attempt, for requests that never get an answer."""
    return fast_retry.model_copy(update={"attempt_timeout_s": 0.5})


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    """A fresh fault-injecting OpenAI-compatible server on a free loopback port."""
    with FaultServer(retry_after_s=0.2, hang_s=20) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's own OpenAI-compatible server serving the bundled SmolLM2 GGUF."""
    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_gguf()),
        "--model_alias",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        # See LocalModel: this llama.cpp build needs one token per micro-batch to be right.
        "--n_ubatch",
        "1",
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
    ]
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"llama_cpp.server exited with {process.returncode} (it needs the server "
                    f"extra: pip install 'llama-cpp-python[server]'):\n{_tail(log)}"
                )
            try:
                if httpx.get(f"{base_url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama_cpp.server did not start in 90 s:\n{_tail(log)}")
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="session")
def local_model() -> LocalModel:
    """The bundled model, loaded once for the session (a small context keeps it quick)."""
    model = LocalModel(n_ctx=2048)
    model.load()
    return model
