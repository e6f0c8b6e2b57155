"""A tracer remembers its redaction of the texts that come back (the system prompt, the budget
report's keys): what it stores is still masked in every step and turn, and a change of the
masking policy is never answered from what was remembered before it."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

from keel.messages import Message
from keel.privacy import ENTITY_TYPES, MaskingPolicy, PIIMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase
from keel.stores._sql_traces import SQLTraceStore
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from keel.tracing import RunQuery, Tracer, redact_json, redact_secrets
from keel.tracing._redact import RedactionMemo
from tests.privacy._samples import MODEL_PII, USER_PII, dump_sqlite, leaks, sentence
from tests.tracing.test_redact import SECRETS

SYSTEM_PROMPT = (
    f"You look records up. Escalations go to {USER_PII['EMAIL']}, key {USER_PII['API_KEY']}."
)


def test_a_repeated_secret_is_masked_in_every_step_of_every_turn(tmp_path: Path) -> None:
    """The same system prompt and message, holding PII and a key, in three turns of two model
    steps each: the second step of a turn and every later turn meet them remembered."""

    @tool
    def lookup(query: str) -> str:
        """Look records up.

        Args:
            query: What to look up.
        """
        return f"records for {query}"

    def policy(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return f"Found it; write to {MODEL_PII['EMAIL']}."
        return ScriptedModel.tool_call("lookup", json.dumps({"query": "item"}))

    agent = Agent.open(
        None,
        settings=load_settings(data_dir=tmp_path, embedder="hashing:256"),
        model=ScriptedModel(policy),
        system_prompt=SYSTEM_PROMPT,
        tools=[lookup],
        memory=False,
    )
    message = f"Card {USER_PII['CREDIT_CARD']}, mail me at {USER_PII['EMAIL']}."

    async def turns() -> list[str]:
        for _ in range(3):
            reply = await agent.handle("s1", "u1", message)
            assert reply.status == "completed"
        store = agent.tracer.store
        assert store is not None
        runs = await store.alist_runs(RunQuery(session_id="s1"))
        details = [await store.aget_run_detail(run.run_id) for run in runs]
        await agent.aclose()
        return [detail.model_dump_json() for detail in details if detail is not None]

    traced = asyncio.run(turns())
    assert len(traced) == 3
    for run in traced:
        assert leaks({"trace": run}, USER_PII, MODEL_PII) == [], run
        # Both model steps kept the system prompt whole, masked (the second one remembered).
        assert run.count("You look records up. Escalations go to <EMAIL_") == 2, run
    dumped = dump_sqlite(next(tmp_path.rglob("*.db")))
    assert dumped["trace_steps"] and dumped["trace_runs"]
    assert leaks({table: dumped[table] for table in ("trace_runs", "trace_steps")}, USER_PII) == []


def _tracer(tmp_path: Path, masker: PIIMasker) -> tuple[Tracer, SQLiteDatabase]:
    database = SQLiteDatabase(tmp_path / "traces.db")
    redact = functools.partial(masker.mask_text, tenant_id="t1")
    return Tracer(SQLTraceStore(database), redact=redact), database


def test_an_agent_tracer_masks_a_repeated_secret_in_every_run(tmp_path: Path) -> None:
    """Without a vault the agent's own tracer records every turn: one memo for all runs."""
    tracer, database = _tracer(tmp_path, PIIMasker())
    text = sentence(USER_PII)
    for turn in range(3):
        with tracer.start_run("s1", input=text) as run:
            run.record("model", "m", raw_output=text, attributes={text: text, "turn": turn})
    database.close()
    dumped = dump_sqlite(tmp_path / "traces.db")
    assert leaks(dumped, USER_PII) == []
    assert dumped["trace_steps"].count("<EMAIL_1>") >= 9


def test_a_new_masking_policy_is_not_answered_from_memory(tmp_path: Path) -> None:
    """A text the old policy left as written is masked once the tenant's policy masks it."""
    masker = PIIMasker(MaskingPolicy(entities=frozenset(ENTITY_TYPES) - {"EMAIL"}))
    tracer, database = _tracer(tmp_path, masker)
    text = f"write to {USER_PII['EMAIL']}"
    with tracer.start_run("s1") as run:
        run.record("model", "m", raw_output=text)
    masker.set_policy("t1", MaskingPolicy())
    with tracer.start_run("s1") as run:
        run.record("model", "m", raw_output=text)
    database.close()
    steps = dump_sqlite(tmp_path / "traces.db")["trace_steps"]
    assert steps.count(USER_PII["EMAIL"]) == 1  # the first run's, under the old policy
    assert "write to <EMAIL_1>" in steps


def test_a_json_walk_asks_the_redactor_only_about_texts_not_known_clean() -> None:
    """A step's JSON fields (a budget report, attributes) come back every step: once a text is
    known clean, walking them again looks it up in the memo without calling the redactor, keys
    included, while the secrets in them, nested in lists and dicts and as a key, are masked
    every time."""
    memo = RedactionMemo(redact_secrets)
    remembered = memo.current()
    asked: list[str] = []

    def counting(text: str) -> str:
        asked.append(text)
        return remembered(text)

    # The walk finds the memo's clean texts on the redactor it is given, as on ``remembered``.
    for name in dir(remembered):
        if name.startswith("keel_"):
            setattr(counting, name, getattr(remembered, name))
    key = SECRETS["aws"]
    value = {
        "sections": {"system": 12, "turns": [{"role": "user", "note": "kept whole"}]},
        key: ["clean item", {"nested": SECRETS["github"]}, (SECRETS["slack"], 1.5)],
    }
    first = redact_json(value, counting)
    assert "clean item" in asked and "sections" in asked
    asked.clear()
    second = redact_json(value, counting)
    # Only the texts with something masked (not known clean) go to the redactor again.
    assert sorted(asked) == sorted([key, SECRETS["github"], SECRETS["slack"]]), asked
    assert first == second
    flat = repr(second)
    assert not [s for s in (key, SECRETS["github"], SECRETS["slack"]) if s in flat], flat
    assert second["sections"] == {"system": 12, "turns": [{"role": "user", "note": "kept whole"}]}
