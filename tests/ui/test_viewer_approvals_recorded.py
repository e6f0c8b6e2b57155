"""The standalone ``keel ui`` viewer holds an agent with none of the application's tools: an
operator's decision there is recorded (channel ``viewer``), as the command line records one,
and the application's own agent carries it out, exactly once (issue 45). Under ``keel serve``
with the application's agent, deciding in the viewer goes on with the turn at once. Real
uvicorn, real HTTP, the embedded SQLite database shared by both."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from keel._bridge import run_sync
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.ui import COOKIE
from tests.approvals._refunds import refund_tool, told
from tests.service.conftest import serving


def _refund_call(order: str) -> Message:
    arguments = json.dumps({"amount": 40.0, "order_id": order})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="issue_refund", arguments=arguments)]
    )


@contextlib.contextmanager
def _viewer(database: str, data_dir: Path, tools: list[Any]) -> Iterator[httpx.Client]:
    """The service with the viewer on ``database`` (``tools``: none, as ``keel ui`` has),
    an operator of tenant ``default`` signed in."""
    app, agents, keys = build_service(
        database,
        model=ScriptedModel([told]),
        tools=tools,
        memory=False,
        settings=load_settings(data_dir=data_dir),
    )
    try:
        with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
            signed = client.post("/ui/login", data={"key": keys.create("default")})
            assert signed.status_code in (200, 303) and COOKIE in client.cookies
            yield client
    finally:
        agents.backends.close()


def test_a_decision_in_the_standalone_viewer_is_carried_out_by_the_application_once(
    tmp_path: Path,
) -> None:
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    refunds: list[str] = []
    with Agent.open(
        database,
        system_prompt="You support a shop's customers.",
        model=ScriptedModel([_refund_call("1024"), told]),
        tools=[refund_tool(refunds)],
        memory=False,
    ) as application:
        parked = application.run_sync("Refund my order 1024.", session="s1", user="ann")
        approval = parked.approvals[0].id
        with _viewer(database, tmp_path / "ui", []) as viewer:
            page = viewer.post(f"/ui/approvals/{approval}", data={"verdict": "approve"})
        assert page.status_code == 200, page.text
        assert f"Approved {approval}" in page.text and "the turn resumed" not in page.text
        assert refunds == []  # recorded only: the viewer runs no tool, and no turn went on
        state = application.session_state("s1")
        assert state is not None and state.runtime.awaiting == (approval,)
        stored = application.approvals.store  # type: ignore[union-attr]
        request = run_sync(stored.aget("default", approval))
        assert request is not None and request.decision is not None
        assert (request.status, request.decision.channel) == ("approved", "viewer")

        went = application.carry_out_decisions_sync()
        assert [reply.session_id for reply in went] == ["s1"], went
        assert "approved by operator:" in went[0].text and refunds == ["1024 40.0"]
        assert application.carry_out_decisions_sync() == [] and refunds == ["1024 40.0"]


def test_under_the_applications_service_the_viewer_goes_on_at_once(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    refunds: list[str] = []
    tools = [refund_tool(refunds)]
    app, agents, keys = build_service(
        database,
        model=ScriptedModel([_refund_call("7"), told]),
        tools=tools,
        memory=False,
        settings=load_settings(data_dir=tmp_path),
    )
    try:
        with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
            key = keys.create("default")
            parked = client.post(
                "/v1/sessions/s1/turns",
                json={"message": "Refund order 7.", "user": "ann"},
                headers={"Authorization": f"Bearer {key}"},
            )
            approval = parked.json()["approvals"][0]["id"]
            assert client.post("/ui/login", data={"key": key}).status_code in (200, 303)
            page = client.post(f"/ui/approvals/{approval}", data={"verdict": "approve"})
        assert "the turn resumed (completed)" in page.text and refunds == ["7 40.0"]
    finally:
        agents.backends.close()
