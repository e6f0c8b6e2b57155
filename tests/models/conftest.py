"""Real parts for the model tests: llama.cpp's own OpenAI server, the fault server, SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from keel.bench.models import TOOL_SCHEMAS
from keel.models import LocalModel, RetryPolicy
from keel.testing import FaultServer
from keel.testing.servers import llama_server

# The tools the model tests offer: the same two ``keel bench models`` counts calls of.
TOOLS = TOOL_SCHEMAS


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
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with llama_server(log=log) as base_url:
        yield base_url


@pytest.fixture(scope="session")
def local_model() -> LocalModel:
    """The bundled model, loaded once for the session (a small context keeps it quick)."""
    model = LocalModel(n_ctx=2048)
    model.load()
    return model
