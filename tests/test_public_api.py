from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import keel


def test_all_is_sorted_and_importable() -> None:
    assert keel.__all__ == sorted(keel.__all__)
    for name in keel.__all__:
        assert getattr(keel, name) is not None, name


def test_lazy_names_resolve_to_their_home_modules() -> None:
    from keel.runtime import Agent
    from keel.tools import tool

    assert keel.Agent is Agent
    assert keel.tool is tool
    assert set(keel.__all__) <= set(dir(keel))


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        keel.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_keel_stays_light() -> None:
    code = (
        "import sys, keel; "
        "print(sorted(m for m in ('torch', 'openai', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_version_is_a_string() -> None:
    assert isinstance(keel.__version__, str) and keel.__version__.count(".") == 2


def test_stores_import_without_server_drivers_or_integrations() -> None:
    code = (
        "import sys, keel.stores, keel.runtime, keel.memory, keel.service, keel.cli; "
        "print(sorted(m for m in ('psycopg', 'redis', 'torch', 'llama_cpp', 'mcp', "
        "'keel.integrations', 'pydantic_ai', 'agents', 'playwright') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_an_agent_can_be_built_by_hand_from_the_top_level_names(tmp_path: Path) -> None:
    from keel import (
        Agent,
        AgentState,
        SQLiteDatabase,
        SQLStateBackend,
        SQLToolJournal,
        SQLTraceStore,
        StateStore,
        Tracer,
    )
    from keel.testing import ScriptedModel

    database = SQLiteDatabase(tmp_path / "keel.db")
    traces = SQLTraceStore(database)
    traces.setup()
    with Agent(
        ScriptedModel(["hi"]),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        journal=SQLToolJournal(database),
        tracer=Tracer(traces),
    ) as agent:
        reply = agent.run_sync("hello", session="s1", user="u1")
    assert reply.status == "completed" and traces.get_run(reply.run_id) is not None
    database.close()
    for name in ("PostgresDatabase", "SQLStateBackend", "RedisStateBackend", "LocalModel"):
        assert name in keel.__all__


def test_tokenizer_plumbing_lives_in_keel_tokens_and_old_names_still_resolve() -> None:
    import keel.tokens

    for name in ("ChatTokenCounter", "Tokenizer", "counter_for", "model_profile"):
        assert name not in keel.__all__
        assert getattr(keel, name) is getattr(keel.tokens, name)
