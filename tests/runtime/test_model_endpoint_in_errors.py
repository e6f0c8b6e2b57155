"""An error about the model's own server names the server (issue 45, item 11): the masker
turned it into ``<IP_ADDRESS_1>`` in ``reply.error``, so an operator could not see which server
was unreachable. The address keel was configured with stays; the user's data is masked still."""

from __future__ import annotations

import socket

import pytest

from keel.errors import ModelUnavailableError
from keel.models import OpenAICompatibleModel, RetryPolicy
from keel.runtime import Agent
from keel.testing import ScriptedModel


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("vault", ["on", "off"])
def test_an_unreachable_model_server_is_named_in_the_reply_error(
    vault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", vault)
    port = _closed_port()
    agent = Agent.open(
        model=f"openai-compatible:m@http://127.0.0.1:{port}/v1",
        memory=False,
        system_prompt="You help.",
    )
    try:
        reply = agent.handle_sync("s1", "u1", "My own server is 10.20.30.40, can you reach it?")
        state = agent.session_state("s1")
    finally:
        agent.close()
    assert reply.status != "completed"
    assert reply.error is not None
    assert f"127.0.0.1:{port}" in reply.error, reply.error
    # The user's address is theirs: masked in what is stored, as before.
    assert state is not None
    stored = " ".join(message.content for message in state.messages)
    assert "10.20.30.40" not in stored and "<IP_ADDRESS_1>" in stored, stored


class _ServerRefuses(ScriptedModel):
    """A model behind a server that answers with an error quoting the user's request."""

    endpoint = "http://10.9.8.7:8000/v1"


@pytest.mark.parametrize("vault", ["on", "off"])
def test_only_the_servers_own_address_is_kept_in_an_error(
    vault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", vault)
    error = ModelUnavailableError(
        f"HTTP 400 from {_ServerRefuses.endpoint}: cannot serve ana@example.com at 10.20.30.40"
    )
    agent = Agent.open(
        model=_ServerRefuses([error], repeat_last=True), memory=False, system_prompt="You help."
    )
    try:
        reply = agent.handle_sync("s1", "u1", "Hello")
    finally:
        agent.close()
    assert reply.error is not None
    assert f"HTTP 400 from {_ServerRefuses.endpoint}: cannot serve" in reply.error, reply.error
    assert "ana@example.com" not in reply.error and "10.20.30.40" not in reply.error


@pytest.mark.parametrize("password", ["s3cret-tail7Qv", "s3cret@tail7Qv"])
def test_a_password_in_the_model_servers_url_is_never_shown_nor_stored(password: str) -> None:
    """The acceptance run found ``cannot reach http://user:PASSWORD@host/v1`` in the reply's
    error (an HTTP client reads it) and in the traces, and the spec, password and all, as the
    model step's name. A password may hold an "@" (httpx reads the user info up to the last
    one): its part after the "@" was shown."""
    port = _closed_port()
    url = f"http://proxy:{password}@127.0.0.1:{port}/v1"
    once = RetryPolicy(max_attempts=1)  # one refused connection says it all
    model = OpenAICompatibleModel("m", base_url=url, api_key="unused", retry=once)
    agent = Agent.open(model=model, memory=False, system_prompt="You help.")
    try:
        reply = agent.handle_sync("s1", "u1", "Hello")
        detail = agent.backends.traces.get_run_detail(reply.run_id)
    finally:
        agent.close()
    assert reply.error is not None and detail is not None
    assert f"http://proxy:***@127.0.0.1:{port}/v1" in reply.error, reply.error
    stored = detail.model_dump_json()
    assert "s3cret" not in stored and "tail7Qv" not in stored, stored
    assert "proxy:***@" in stored, stored
    assert "s3cret" not in agent.model.spec and "tail7Qv" not in agent.model.spec
    assert "tail7Qv" not in reply.error
