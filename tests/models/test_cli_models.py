"""``keel complete`` and ``keel bench models`` as a user runs them: real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from keel.testing import FaultServer


def _keel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


def test_complete_scripted_json() -> None:
    result = _keel("complete", "--model", "scripted:gpt-4o-mini", "--json", "ping")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["text"] == "ping"
    assert payload["finish_reason"] == "stop" and payload["truncated"] is False
    assert payload["usage"]["prompt_tokens"] > 0
    assert payload["usage"]["total_tokens"] == (
        payload["usage"]["prompt_tokens"] + payload["usage"]["completion_tokens"]
    )


def test_complete_typed_failure_is_one_line(fault_server: FaultServer) -> None:
    result = _keel(
        "complete", "--model", f"openai-compatible:unauthorized@{fault_server.base_url}", "hi"
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "HTTP 401" in result.stderr and "Incorrect API key" in result.stderr


def test_complete_unknown_model_is_a_usage_error() -> None:
    result = _keel("complete", "--model", "local:nope", "hi")
    assert result.returncode == 2
    assert "unknown model" in result.stderr


@pytest.mark.slow
def test_complete_local_say_hello_within_60s() -> None:
    started = time.monotonic()
    result = _keel("complete", "--model", "local:smollm2", "--json", "Say hello", timeout=90)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert elapsed < 60
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["model"] == "local:smollm2"
    assert payload["text"].strip()
    assert payload["usage"]["prompt_tokens"] > 0 and payload["usage"]["completion_tokens"] > 0
    assert payload["ttft_ms"] is not None


def test_bench_models_faults_json() -> None:
    result = _keel("bench", "models", "--skip-local", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    faults = report["faults"]
    assert faults["unhandled"] == 0
    assert faults["total"] == len(faults["kinds"]) >= 10
    expected = {row["expected"] for row in faults["kinds"].values()}
    assert {"ok", "RateLimitError", "ModelTimeoutError", "TruncatedResponseError"} <= expected
    assert {"ContextLengthExceededError", "AuthenticationError", "MalformedResponseError"} <= (
        expected
    )
