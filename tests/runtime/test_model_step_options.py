"""What a turn's model call is given for options: the guards' model timeout unless the caller
set one, and ``allow_truncated`` (a cut answer is the loop's to continue), whatever else the
caller's options say."""

from __future__ import annotations

from pathlib import Path

from keel.guards import GuardConfig
from keel.models import ModelOptions
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel


def _options(tmp_path: Path, options: ModelOptions | None) -> list[ModelOptions]:
    model = ScriptedModel(["Hello."])
    agent = Agent.open(
        None,
        settings=load_settings(data_dir=tmp_path, embedder="hashing:64"),
        model=model,
        system_prompt="You answer.",
        guards=GuardConfig(model_timeout_s=7.0),
        model_options=options,
        memory=False,
    )
    try:
        reply = agent.handle_sync("s1", "u1", "hi")
    finally:
        agent.close()
    assert reply.status == "completed", reply
    return [call.options for call in model.calls]


def test_the_model_is_given_the_guards_timeout_and_may_be_cut(tmp_path: Path) -> None:
    (options,) = _options(tmp_path, ModelOptions(temperature=0.3))
    assert options.timeout_s == 7.0
    assert options.allow_truncated is True
    assert options.temperature == 0.3


def test_a_callers_own_timeout_is_kept(tmp_path: Path) -> None:
    (options,) = _options(tmp_path, ModelOptions(timeout_s=2.5))
    assert options.timeout_s == 2.5
    assert options.allow_truncated is True
