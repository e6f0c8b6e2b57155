"""``keel bench integrations`` as a user runs it: LangGraph's ReAct agent on both checkpointers,
the Agents SDK's Runner on both sessions."""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow


def test_bench_integrations_json_contract_and_keel_never_overflows() -> None:
    report = bench_json("integrations", "--turns", "60", "--langgraph-steps", "0")
    assert report["langgraph"] is None
    figures = report["openai_agents"]
    keel, sdk = figures["keel"], figures["sqlite_session"]
    assert keel["model_calls"] == sdk["model_calls"] == 120
    assert keel["orphans"] == 0 and keel["overflows"] == 0
    assert keel["prompt_tokens_max"] <= figures["prompt_limit"]
    assert sdk["prompt_tokens_max"] > figures["prompt_limit"], "the workload must stress a limit"


def test_bench_integrations_langgraph_half_counts_from_both_databases() -> None:
    report = bench_json("integrations", "--turns", "0", "--langgraph-steps", "30")
    graph = report["langgraph"]
    assert report["openai_agents"] is None
    assert graph["steps"] == 30
    # Five checkpoints per step (the input, then one per super-step), listed from each database.
    assert graph["keel"]["checkpoints"] == graph["sqlite_saver"]["checkpoints"] == 5 * 30
    assert graph["keel_bytes"] > 0 and graph["sqlite_saver_bytes"] > graph["keel_bytes"]
    assert graph["conformance"] == {"sqlite": True, "postgres": True}
