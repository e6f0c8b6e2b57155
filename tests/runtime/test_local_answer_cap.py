"""The bundled model's answers are capped (issue 45, item 5): SmolLM2 ran to 2,048 tokens and
was then asked to continue, and "Do you remember my email?" took two minutes and failed. Each
answer now stops at ``local_max_answer_tokens`` and the turn ends there with that answer,
reported cut: never a chain of continuations."""

from __future__ import annotations

import pytest

from keel.errors import ConfigError
from keel.models import resolve_model
from keel.runtime import Agent
from keel.settings import load_settings

_CAP = 8
"""Well below what SmolLM2 writes to the question (20 tokens and more), so the cap must cut."""


def test_the_bundled_model_is_capped_by_the_setting_or_its_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # getattr: on a keel without the cap, this fails as an assertion, not an AttributeError.
    assert getattr(resolve_model("local:smollm2"), "max_answer_tokens", None) == 384
    assert load_settings().local_max_answer_tokens == 384
    monkeypatch.setenv("KEEL_LOCAL_MAX_ANSWER_TOKENS", "200")
    assert resolve_model("local:smollm2").max_answer_tokens == 200
    assert resolve_model("local:smollm2?max_answer_tokens=64").max_answer_tokens == 64
    with pytest.raises(ConfigError, match=r"\?max_answer_tokens=N"):
        resolve_model("local:smollm2?max_tokens=64")


def test_a_rambling_local_answer_ends_at_the_cap_as_the_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEEL_LOCAL_MAX_ANSWER_TOKENS", str(_CAP))
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    agent = Agent.open(
        model="local:smollm2",
        memory=False,
        system_prompt="You are the support agent of an online shop.",
    )
    try:
        reply = agent.handle_sync("s1", "u1", "Do you remember my email?")
        assert agent.tracer is not None and agent.tracer.store is not None
        detail = agent.tracer.store.get_run_detail(reply.run_id)
    finally:
        agent.close()
    assert detail is not None
    calls = [step for step in detail.steps if step.kind == "model"]
    # One call, stopped at the cap: not asked to continue, not failed.
    assert [step.completion_tokens <= _CAP for step in calls] == [True], calls
    assert reply.status == "completed" and reply.error is None, reply
    assert reply.steps == 1 and reply.truncated and reply.text.strip()
