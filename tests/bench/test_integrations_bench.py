"""``keel bench integrations`` as a user runs it: the Agents SDK's Runner on both sessions."""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow


def test_bench_integrations_json_contract_and_keel_never_overflows() -> None:
    report = bench_json("integrations", "--turns", "60")
    figures = report["openai_agents"]
    keel, sdk = figures["keel"], figures["sqlite_session"]
    assert keel["model_calls"] == sdk["model_calls"] == 120
    assert keel["orphans"] == 0 and keel["overflows"] == 0
    assert keel["prompt_tokens_max"] <= figures["prompt_limit"]
    assert sdk["prompt_tokens_max"] > figures["prompt_limit"], "the workload must stress a limit"
