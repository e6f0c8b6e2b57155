"""``keel bench integrations`` as a user runs it: the Agents SDK's Runner on both sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_integrations_json_contract_and_keel_never_overflows() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "integrations", "--turns", "60", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    figures = report["openai_agents"]
    keel, sdk = figures["keel"], figures["sqlite_session"]
    assert keel["model_calls"] == sdk["model_calls"] == 120
    assert keel["orphans"] == 0 and keel["overflows"] == 0
    assert keel["prompt_tokens_max"] <= figures["prompt_limit"]
    assert sdk["prompt_tokens_max"] > figures["prompt_limit"], "the workload must stress a limit"
