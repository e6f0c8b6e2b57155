"""A model step's trace keeps the messages the call was sent (issue 49), masked as the history
holds them: through a real ``Agent`` on SQLite, the viewer's run page can show what the model
saw, and no PII the user typed or a tool returned reaches the trace in the clear."""

from __future__ import annotations

import json
from pathlib import Path

from keel._bridge import run_sync
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import tool
from keel.tracing import RunDetail, Step
from keel.ui._views import prompt_messages
from tests.privacy._samples import TOOL_PII, USER_PII, dump_sqlite, leaks, sentence


@tool
def look_up_customer(name: str) -> str:
    """Find a customer's contact details."""
    return f"{name}: {sentence(TOOL_PII)}"


def test_each_model_step_keeps_the_masked_messages_it_was_sent(tmp_path: Path) -> None:
    call = ToolCall(id="c1", name="look_up_customer", arguments=json.dumps({"name": "Ada"}))
    model = ScriptedModel([Message.assistant("", tool_calls=[call]), "I found Ada's details."])
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=model,
        memory=False,
        tools=[look_up_customer],
        system_prompt="You help the support team.",
    )
    try:
        reply = agent.handle_sync("s1", "u1", f"Please find Ada. {sentence(USER_PII)}")
        detail = agent.tracer.store.get_run_detail(reply.run_id)  # type: ignore[union-attr]
        _check(agent, detail, tmp_path)
    finally:
        agent.close()


def _check(agent: Agent, detail: RunDetail | None, tmp_path: Path) -> None:
    assert detail is not None
    first, second = [step for step in detail.steps if step.kind == "model"]
    # The blocks whole; the session's messages by their positions in its checkpoint.
    kept = first.attributes["prompt"]
    assert kept[0] == {"role": "system", "content": "You help the support team."}
    assert {"messages": [0, 0]} in kept
    assert {"messages": [0, 2]} in second.attributes["prompt"]
    sent = [_shown(agent, step) for step in (first, second)]
    assert sent[0][0] == ("system", "You help the support team.")
    assert sent[0][-1][0] == "user" and sent[0][-1][1].startswith("Please find Ada.")
    assert [role for role, _ in sent[1][-3:]] == ["user", "assistant", "tool"]
    assert "look_up_customer" in sent[1][-2][1] and "Ada" in sent[1][-1][1]
    traces = dump_sqlite(tmp_path / "keel.db")
    steps = {name: text for name, text in traces.items() if name == "trace_steps"}
    assert steps and leaks(steps, USER_PII, TOOL_PII) == []
    assert all(USER_PII["EMAIL"] not in text for _, text in sent[0])


def _shown(agent: Agent, step: Step) -> list[tuple[str, str]]:
    """What the viewer's run page shows of ``step``'s prompt: the messages it names read
    from the session's checkpoint at the step's version."""
    assert step.state_version is not None
    checkpoint = run_sync(agent.state.aat(agent.session_key("s1"), step.state_version))
    shown = prompt_messages(step, checkpoint.state.messages)
    return [(m.role, m.content + "".join(m.tool_calls)) for m in shown]
