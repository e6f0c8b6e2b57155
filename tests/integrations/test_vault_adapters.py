"""The PII vault inside the adapters, through each framework's own runner: a LangGraph graph
resumed from keel's checkpoints in a new process, an Agents SDK run reading keel's session and a
pydantic-ai run given the history keel stored see the user's real values where the framework's
own store would have given them; storage holds placeholders only (every table of the SQLite
file and its write-ahead log, payloads decoded); another user of the same tenant reading the
same thread gets placeholders."""

from __future__ import annotations

import base64
import json
import operator
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Send
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.messages import ModelMessage, ModelRequest, TextPart, ToolCallPart, UserPromptPart
from pydantic_ai.messages import ModelResponse as PydanticResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from keel.errors import AccessDeniedError, ConflictError, VaultKeyError
from keel.integrations.langgraph import KeelCheckpointSaver
from keel.integrations.openai_agents import KeelSession
from keel.integrations.pydantic_ai import KeelMessageStore
from keel.privacy import MasterKey, Vault
from keel.settings import default_pii_key_file
from keel.stores import SQLiteDatabase, SQLiteVaultStore

EMAIL = "alice.smith@example.com"
OTHER_EMAIL = "a.smith@work.example.org"
PHONE = "+1 415 555 0134"

_PAYLOAD = re.compile(rb"[a-z]+:([A-Za-z0-9+/]{16,}={0,2})")
"""A value a LangGraph checkpoint stores: its serializer's kind, then the bytes in base64."""


def _everything_stored(path: Path) -> bytes:
    """Every row of every table of the SQLite file, the file's and its write-ahead log's raw
    bytes, and every base64 payload found in them decoded (checkpoints store values so)."""
    parts: list[bytes] = []
    with closing(sqlite3.connect(path)) as conn:
        query = "SELECT name FROM sqlite_master WHERE type = 'table'"
        for (table,) in conn.execute(query).fetchall():
            parts.extend(repr(row).encode() for row in conn.execute(f'SELECT * FROM "{table}"'))
    parts.append(path.read_bytes())
    wal = path.with_name(path.name + "-wal")
    if wal.exists():
        parts.append(wal.read_bytes())
    raw = b"\n".join(parts)
    decoded = []
    for match in _PAYLOAD.finditer(raw):
        try:
            decoded.append(base64.b64decode(match.group(1), validate=True))
        except ValueError:
            continue
    return raw + b"\n" + b"\n".join(decoded)


@pytest.fixture
def key_text() -> str:
    """The master key as a deployment sets ``KEEL_PII_KEY``."""
    return MasterKey.new_key_text()


@pytest.fixture
def key(key_text: str) -> MasterKey:
    return MasterKey.from_text(key_text)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "keel.db"


@pytest.fixture
def vault(db_path: Path, key: MasterKey) -> Iterator[Vault]:
    """The vault on the adapters' own SQLite file, as a deployment keeps it."""
    with SQLiteDatabase(db_path) as database:
        opened = Vault(SQLiteVaultStore(database), key)
        opened.check()
        yield opened


@pytest.fixture
def masking_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter given no vault masks alone, as a deployment says with ``KEEL_PII_VAULT=off``
    (otherwise, on SQLite, it opens the vault under keel's own key file)."""
    monkeypatch.setenv("KEEL_PII_VAULT", "off")


# --- LangGraph ----------------------------------------------------------------------------------

RECEIVED: list[str] = []
"""What ``send_receipt`` was called with, in this process."""


@tool
def send_receipt(email: str) -> str:
    """Send the order's receipt to an e-mail address."""
    RECEIVED.append(email)
    return f"receipt sent to {email}"


class _Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _assistant(state: _Chat) -> dict[str, Any]:
    """A scripted model: asked for the receipt, it sends it to the address the user gave
    earlier in the thread (as the thread reads now); after the tool, it answers."""
    last = state["messages"][-1]
    if isinstance(last, ToolMessage):
        return {"messages": [AIMessage(content="Sent.")]}
    if "receipt" not in str(last.content):
        return {"messages": [AIMessage(content="Noted.")]}
    said = " ".join(str(m.content) for m in state["messages"] if isinstance(m, HumanMessage))
    address = re.findall(r"<EMAIL_\d+>|\S+@\S+", said)[0]
    call = {"name": "send_receipt", "args": {"email": address}, "id": "call-1"}
    return {"messages": [AIMessage(content="", tool_calls=[call])]}


def receipt_graph(saver: Any) -> Any:
    """The assistant and a tool node, interrupted before the tool runs."""
    graph = StateGraph(_Chat)
    graph.add_node("assistant", _assistant)
    graph.add_node("tools", ToolNode([send_receipt]))
    graph.add_edge(START, "assistant")
    graph.add_conditional_edges("assistant", tools_condition)
    graph.add_edge("tools", "assistant")
    return graph.compile(checkpointer=saver, interrupt_before=["tools"])


def _alice(thread: str = "t1") -> dict[str, Any]:
    return {"configurable": {"thread_id": thread, "user_id": "alice"}}


def _up_to_the_tool(saver: Any) -> None:
    """Two turns of alice's: her address, then the request that stops before the tool."""
    graph = receipt_graph(saver)
    graph.invoke({"messages": [HumanMessage(content=f"My email is {EMAIL}")]}, _alice())
    graph.invoke({"messages": [HumanMessage(content="Please send my receipt")]}, _alice())
    assert graph.get_state(_alice()).next == ("tools",)


_RESUME = """
import json, sys
sys.path.insert(0, sys.argv[2])
from test_vault_adapters import RECEIVED, receipt_graph, resuming_saver
with resuming_saver(sys.argv[1]) as saver:
    receipt_graph(saver).invoke(None, {"configurable": {"thread_id": "t1", "user_id": "alice"}})
print(json.dumps(RECEIVED))
"""


def resuming_saver(path: str) -> KeelCheckpointSaver:
    """The saver a new process opens: no vault given, ``KEEL_PII_KEY`` in the environment
    opens it on the checkpoints' database."""
    return KeelCheckpointSaver(f"sqlite:///{path}", tenant="acme")


def _resumed_in_a_new_process(db_path: Path, key_text: str | None) -> list[str]:
    """What the tool got in a new process resuming alice's thread: the vault opened by
    ``KEEL_PII_KEY``, or with none by keel's own key file (this test's config directory)."""
    environment = dict(os.environ)
    if key_text is not None:
        environment["KEEL_PII_KEY"] = key_text
    done = subprocess.run(
        [sys.executable, "-c", _RESUME, str(db_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    received: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return received


def test_a_graph_resumed_in_a_new_process_runs_its_tool_with_the_address_as_sqlitesaver(
    db_path: Path, key_text: str, vault: Vault, tmp_path: Path
) -> None:
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        _up_to_the_tool(saver)
    keel_received = _resumed_in_a_new_process(db_path, key_text)

    RECEIVED.clear()
    with SqliteSaver.from_conn_string(str(tmp_path / "langgraph.db")) as own:
        _up_to_the_tool(own)
    with SqliteSaver.from_conn_string(str(tmp_path / "langgraph.db")) as own_again:
        receipt_graph(own_again).invoke(None, _alice())
    assert keel_received == RECEIVED == [EMAIL]

    stored = _everything_stored(db_path)
    assert b"<EMAIL_1>" in stored, "the payloads were read: the placeholder is in them"
    assert EMAIL.encode() not in stored and b"alice.smith" not in stored


@pytest.mark.usefixtures("masking_alone")
def test_another_user_of_the_tenant_reads_the_thread_with_placeholders(
    db_path: Path, vault: Vault
) -> None:
    """bob has a ``<EMAIL_1>`` of his own: reading alice's thread, he gets her placeholders,
    never her values nor his own in their place, and cannot write to it."""
    bob = {"configurable": {"thread_id": "t1", "user_id": "bob"}}
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        _up_to_the_tool(saver)
        bobs_own = {"configurable": {"thread_id": "t-bob", "user_id": "bob"}}
        said = {"messages": [HumanMessage(content=f"I am {OTHER_EMAIL}")]}
        receipt_graph(saver).invoke(said, bobs_own)
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        for config, address in ((bob, "<EMAIL_1>"), (_alice(), EMAIL)):
            messages = receipt_graph(saver).get_state(config).values["messages"]
            assert messages[0].content == f"My email is {address}"
            assert messages[-1].tool_calls[0]["args"] == {"email": address}
        history = repr([t.checkpoint for t in saver.list(bob)])
        assert "<EMAIL_1>" in history and EMAIL not in history and OTHER_EMAIL not in history
        with pytest.raises(AccessDeniedError):
            receipt_graph(saver).invoke(None, bob)
    without = KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme")
    with without, pytest.raises(VaultKeyError, match="sealed in a PII vault"):
        receipt_graph(without).invoke(None, _alice())


@pytest.mark.usefixtures("masking_alone")
def test_a_thread_stored_before_the_vault_keeps_its_placeholders(
    db_path: Path, vault: Vault
) -> None:
    """Its placeholders were numbered per text, not by the user's vault: revealing them with
    the vault would put other values in their place."""
    url = f"sqlite:///{db_path}"
    with KeelCheckpointSaver(url, tenant="acme") as before:
        receipt_graph(before).invoke(
            {"messages": [HumanMessage(content=f"to {OTHER_EMAIL}")]}, _alice()
        )
    with KeelCheckpointSaver(url, tenant="acme", vault=vault) as saver:
        receipt_graph(saver).invoke(
            {"messages": [HumanMessage(content=f"to {EMAIL}")]}, _alice("t2")
        )
        graph = receipt_graph(saver)
        graph.invoke({"messages": [HumanMessage(content=f"and {EMAIL}")]}, _alice())
        texts = [m.content for m in graph.get_state(_alice()).values["messages"]]
    assert texts[0] == "to <EMAIL_1>" and texts[2] == "and <EMAIL_1>"


@pytest.mark.usefixtures("masking_alone")
def test_one_address_keeps_its_placeholder_in_every_turn_and_thread_of_the_user(
    db_path: Path, vault: Vault
) -> None:
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        graph = receipt_graph(saver)
        for thread, text in (("t1", EMAIL), ("t1", OTHER_EMAIL), ("t2", f"{OTHER_EMAIL} {EMAIL}")):
            graph.invoke({"messages": [HumanMessage(content=f"write {text}")]}, _alice(thread))
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme") as masked:
        texts = [
            str(m.content)
            for thread in ("t1", "t2")
            for m in receipt_graph(masked).get_state(_alice(thread)).values["messages"]
            if isinstance(m, HumanMessage)
        ]
    assert texts == ["write <EMAIL_1>", "write <EMAIL_2>", "write <EMAIL_2> <EMAIL_1>"]


def test_after_forget_the_same_saver_reads_placeholders_not_what_it_had_cached(
    db_path: Path, vault: Vault
) -> None:
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        graph = receipt_graph(saver)
        _up_to_the_tool(saver)
        assert graph.get_state(_alice()).values["messages"][0].content == f"My email is {EMAIL}"
        assert vault.forget("acme", "alice") == 1
        messages = graph.get_state(_alice()).values["messages"]
        assert messages[0].content == "My email is <EMAIL_1>"
        RECEIVED.clear()
        graph.invoke(None, _alice())
        assert RECEIVED == ["<EMAIL_1>"], "an erased value reached the tool"


class _Fanned(TypedDict):
    done: Annotated[list[str], operator.add]


def test_a_sends_argument_is_stored_masked_and_its_node_gets_the_value_on_resume(
    db_path: Path, vault: Vault
) -> None:
    """A ``Send`` carries its argument in the checkpoint's pending tasks: masked there like
    every channel value, the value given back to its node when the graph resumes."""
    got: list[str] = []

    def work(task: dict[str, str]) -> dict[str, Any]:
        got.append(task["email"])
        return {"done": ["mailed"]}

    builder = StateGraph(_Fanned)
    builder.add_node("work", work)
    builder.add_conditional_edges(START, lambda _: [Send("work", {"email": OTHER_EMAIL})])
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        graph = builder.compile(checkpointer=saver, interrupt_before=["work"])
        graph.invoke({"done": []}, _alice())
    stored = _everything_stored(db_path)
    assert OTHER_EMAIL.encode() not in stored and b"<EMAIL_1>" in stored
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        graph = builder.compile(checkpointer=saver, interrupt_before=["work"])
        assert graph.invoke(None, _alice())["done"] == ["mailed"]
    assert got == [OTHER_EMAIL]


# --- the OpenAI Agents SDK ----------------------------------------------------------------------

set_tracing_disabled(True)


@function_tool
def mail_receipt(email: str) -> str:
    """Send the order's receipt to an e-mail address.

    Args:
        email: where to send it.
    """
    RECEIVED.append(email)
    return f"receipt sent to {email}"


def _said(texts: list[str]) -> list[str]:
    return re.findall(r"<EMAIL_\d+>|[\w.+-]+@[\w.-]+\w", " ".join(texts))


class _Mailer(Model):
    """A scripted model: asked for the receipt, it calls ``mail_receipt`` with the first
    address the user gave in the input it was sent; otherwise it answers."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: Any,
        *args: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        items = [dict(item) for item in input]
        last = items[-1]
        if last.get("type") != "function_call_output" and "receipt" in str(last.get("content")):
            users = [str(i.get("content")) for i in items if i.get("role") == "user"]
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id=f"call-{len(items)}",
                name="mail_receipt",
                arguments=json.dumps({"email": _said(users)[0]}),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text="Noted.", annotations=[])
        message = ResponseOutputMessage(
            id="m", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _users_texts(items: list[dict[str, Any]]) -> list[str]:
    return [str(item["content"]) for item in items if item.get("role") == "user"]


async def test_an_agents_sdk_run_reads_the_address_the_first_turn_gave_from_keels_session(
    db_path: Path, vault: Vault, key_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = f"sqlite:///{db_path}"
    agent = Agent(name="shop", model=_Mailer(), tools=[mail_receipt])
    first = KeelSession("conv-1", database=database, tenant="acme", user_id="alice", vault=vault)
    await Runner.run(agent, f"My email is {EMAIL}", session=first)
    await Runner.run(agent, f"My work email is {OTHER_EMAIL}", session=first)
    first.close()
    RECEIVED.clear()
    # Another session object, the vault opened on its database by the environment's key.
    monkeypatch.setenv("KEEL_PII_KEY", key_text)
    second = KeelSession("conv-1", database=database, tenant="acme", user_id="alice")
    await Runner.run(agent, "Please send my receipt", session=second)
    assert RECEIVED == [EMAIL]
    # Two addresses in two items: two placeholders in storage, each read back as itself.
    assert _users_texts(await second.all_items())[:2] == [
        "My email is <EMAIL_1>",
        "My work email is <EMAIL_2>",
    ]
    assert _users_texts(await second.get_items())[:2] == [
        f"My email is {EMAIL}",
        f"My work email is {OTHER_EMAIL}",
    ]
    second.close()
    stored = _everything_stored(db_path)
    assert b"<EMAIL_2>" in stored
    assert EMAIL.encode() not in stored and OTHER_EMAIL.encode() not in stored


@pytest.mark.usefixtures("masking_alone")
async def test_another_user_reading_the_session_gets_placeholders_and_pop_reveals(
    db_path: Path, vault: Vault
) -> None:
    """bob has a ``<EMAIL_1>`` of his own: reading alice's session he gets her placeholders,
    never her values nor his own in their place, and cannot add to it; a session object
    without the vault cannot add to it either."""
    database = f"sqlite:///{db_path}"
    alice = KeelSession("conv-1", database=database, tenant="acme", user_id="alice", vault=vault)
    await alice.add_items(
        [
            {"role": "user", "content": f"mail {EMAIL}"},
            {"role": "user", "content": f"or {OTHER_EMAIL}, never {EMAIL}"},
        ]
    )
    bobs_own = KeelSession("conv-b", database=database, tenant="acme", user_id="bob", vault=vault)
    await bobs_own.add_items([{"role": "user", "content": f"I am {OTHER_EMAIL}"}])
    bob = KeelSession("conv-1", database=database, tenant="acme", user_id="bob", vault=vault)
    assert _users_texts(await bob.get_items()) == [
        "mail <EMAIL_1>",
        "or <EMAIL_2>, never <EMAIL_1>",
    ]
    with pytest.raises(AccessDeniedError):
        await bob.add_items([{"role": "user", "content": f"mine: {OTHER_EMAIL}"}])
    without = KeelSession("conv-1", database=database, tenant="acme", user_id="alice")
    with pytest.raises(VaultKeyError, match="sealed in a PII vault"):
        await without.add_items([{"role": "user", "content": f"again {EMAIL}"}])
    assert await bob.pop_item() == {"role": "user", "content": "or <EMAIL_2>, never <EMAIL_1>"}
    assert await alice.pop_item() == {"role": "user", "content": f"mail {EMAIL}"}
    for session in (alice, bobs_own, bob, without):
        session.close()


@pytest.mark.usefixtures("masking_alone")
async def test_without_a_vault_one_write_numbers_its_items_together(db_path: Path) -> None:
    session = KeelSession("conv-1", database=f"sqlite:///{db_path}")
    await session.add_items(
        [
            {"role": "user", "content": f"mail {EMAIL}"},
            {"role": "user", "content": f"or {OTHER_EMAIL}, never {EMAIL}"},
        ]
    )
    assert _users_texts(await session.get_items()) == [
        "mail <EMAIL_1>",
        "or <EMAIL_2>, never <EMAIL_1>",
    ]
    session.close()


# --- pydantic-ai --------------------------------------------------------------------------------


def _receipt_agent() -> PydanticAgent[None, str]:
    """A pydantic-ai agent on a scripted model: asked for the receipt, it calls
    ``send_receipt`` with the first address the user gave in the history it was sent."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(
            isinstance(part, UserPromptPart) and "receipt" in str(part.content)
            for part in last.parts
        ):
            users = [
                str(part.content)
                for message in messages
                if isinstance(message, ModelRequest)
                for part in message.parts
                if isinstance(part, UserPromptPart)
            ]
            call = ToolCallPart("send_receipt", {"email": _said(users)[0]}, tool_call_id="c1")
            return PydanticResponse(parts=[call])
        return PydanticResponse(parts=[TextPart("Noted.")])

    agent = PydanticAgent(FunctionModel(respond))

    @agent.tool_plain
    def send_receipt(email: str) -> dict[str, str]:
        """Send the order's receipt to an e-mail address."""
        RECEIVED.append(email)
        return {"sent_to": email}

    return agent


async def test_a_pydantic_ai_run_given_keels_history_gets_the_values_storage_placeholders(
    db_path: Path, vault: Vault, key_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = f"sqlite:///{db_path}"
    agent = _receipt_agent()
    first = KeelMessageStore(
        "conv-1", database=database, tenant="acme", user_id="alice", vault=vault
    )
    result = await agent.run(f"My email is {EMAIL}", message_history=await first.load())
    await first.save(result.all_messages())
    result = await agent.run(f"My work email is {OTHER_EMAIL}", message_history=await first.load())
    await first.save(result.all_messages())
    first.close()
    RECEIVED.clear()
    # Another store object, the vault opened on its database by the environment's key.
    monkeypatch.setenv("KEEL_PII_KEY", key_text)
    later = KeelMessageStore("conv-1", database=database, tenant="acme", user_id="alice")
    result = await agent.run("Please send my receipt", message_history=await later.load())
    assert RECEIVED == [EMAIL]
    await later.save(result.all_messages())
    stored = json.dumps(await later.stored())
    assert "My email is <EMAIL_1>" in stored and "My work email is <EMAIL_2>" in stored
    assert '"sent_to": "<EMAIL_1>"' in stored, "the tool's return is masked too"
    later.close()
    everything = _everything_stored(db_path)
    assert EMAIL.encode() not in everything and OTHER_EMAIL.encode() not in everything

    bob = KeelMessageStore("conv-1", database=database, tenant="acme", user_id="bob", vault=vault)
    texts = [
        str(part.content)
        for message in await bob.load()
        for part in message.parts
        if isinstance(part, UserPromptPart)
    ]
    assert texts[:2] == ["My email is <EMAIL_1>", "My work email is <EMAIL_2>"]
    with pytest.raises(AccessDeniedError):
        await bob.save(
            (await agent.run("bob's turn", message_history=await bob.load())).all_messages()
        )
    bob.close()


async def test_a_save_over_a_history_saved_since_is_rejected_and_stores_nothing(
    db_path: Path,
) -> None:
    database = f"sqlite:///{db_path}"
    agent = _receipt_agent()
    one = KeelMessageStore("conv-1", database=database)
    two = KeelMessageStore("conv-1", database=database)
    assert await one.load() == [] and await two.load() == []
    await one.save((await agent.run("from one")).all_messages())
    with pytest.raises(ConflictError):
        await two.save((await agent.run("from two")).all_messages())
    assert "from two" not in json.dumps(await one.stored())
    one.close()
    two.close()


# --- the vault from the environment -------------------------------------------------------------


def test_a_malformed_key_in_the_environment_is_a_typed_error_before_anything_opens(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", "not-a-key")
    for open_one in (
        lambda: KeelCheckpointSaver(f"sqlite:///{db_path}"),
        lambda: KeelSession("conv-1", database=f"sqlite:///{db_path}"),
        lambda: KeelMessageStore("conv-1", database=f"sqlite:///{db_path}"),
    ):
        with pytest.raises(VaultKeyError, match="KEEL_PII_KEY"):
            open_one()
    assert not db_path.exists(), "a database was opened before the key was read"


def test_another_master_key_than_the_vaults_is_refused(
    db_path: Path, vault: Vault, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    with pytest.raises(VaultKeyError, match="not this vault's"):
        KeelCheckpointSaver(f"sqlite:///{db_path}")
    with pytest.raises(VaultKeyError, match="not this vault's"):
        KeelSession("conv-1", database=f"sqlite:///{db_path}")
    with pytest.raises(VaultKeyError, match="not this vault's"):
        KeelMessageStore("conv-1", database=f"sqlite:///{db_path}")


def test_with_no_key_on_sqlite_a_resumed_graph_gets_the_value_under_keels_own_key_file(
    db_path: Path,
) -> None:
    """No ``KEEL_PII_KEY``: the saver opens the vault as ``Backends.open`` does, under the key
    file keel makes in the config directory; a new process finds the same key there."""
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme") as saver:
        assert saver.vault is not None
        _up_to_the_tool(saver)
    RECEIVED.clear()
    assert _resumed_in_a_new_process(db_path, None) == [EMAIL]
    assert default_pii_key_file().exists()
    stored = _everything_stored(db_path)
    assert b"<EMAIL_1>" in stored and EMAIL.encode() not in stored


async def test_with_no_key_on_sqlite_the_sessions_and_stores_read_the_value_back(
    db_path: Path,
) -> None:
    """A second session and a second message store, opened on the same file with no key,
    read the value the first one stored: one vault, keel's own key file."""
    database = f"sqlite:///{db_path}"
    said = {"role": "user", "content": f"mail {EMAIL}"}
    async with KeelSession("conv-1", database=database, user_id="alice") as first:
        await first.add_items([said])
    async with KeelSession("conv-1", database=database, user_id="alice") as second:
        assert second.vault is not None
        assert _users_texts(await second.get_items()) == [f"mail {EMAIL}"]
        assert _users_texts(await second.all_items()) == ["mail <EMAIL_1>"]
    async with KeelMessageStore("conv-2", database=database, user_id="alice") as first_store:
        await first_store.save([ModelRequest(parts=[UserPromptPart(content=f"mail {EMAIL}")])])
    async with KeelMessageStore("conv-2", database=database, user_id="alice") as second_store:
        loaded = await second_store.load()
        assert loaded[0].parts[0].content == f"mail {EMAIL}"
    assert EMAIL.encode() not in _everything_stored(db_path)


def test_with_keel_pii_vault_off_the_adapters_mask_alone(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    database = f"sqlite:///{db_path}"
    with KeelCheckpointSaver(database) as saver:
        assert saver.vault is None
    for adapter in (KeelSession("c", database=database), KeelMessageStore("c", database=database)):
        assert adapter.vault is None
        adapter.close()
    assert not default_pii_key_file().exists()


def test_on_postgresql_the_environments_key_opens_the_vault_beside_the_checkpoints(
    postgres_url: str, key_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", key_text)
    with KeelCheckpointSaver(postgres_url, tenant="acme") as saver:
        assert saver.vault is not None
        _up_to_the_tool(saver)
    RECEIVED.clear()
    with KeelCheckpointSaver(postgres_url, tenant="acme") as saver:
        receipt_graph(saver).invoke(None, _alice())
    assert RECEIVED == [EMAIL]
    monkeypatch.delenv("KEEL_PII_KEY")
    # A server database that holds a vault is refused without its key, as Backends.open does.
    with pytest.raises(VaultKeyError, match="holds a PII vault"):
        KeelCheckpointSaver(postgres_url, tenant="acme")
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    with KeelCheckpointSaver(postgres_url, tenant="acme") as masked:
        stored = masked.get_tuple(_alice())
        assert stored is not None and EMAIL not in repr(stored.checkpoint)
        assert "<EMAIL_1>" in repr(stored.checkpoint)


def test_a_vault_given_with_checkpoints_on_redis(redis_url: str, vault: Vault) -> None:
    with KeelCheckpointSaver(redis_url, tenant="acme", vault=vault) as saver:
        _up_to_the_tool(saver)
    RECEIVED.clear()
    with KeelCheckpointSaver(redis_url, tenant="acme", vault=vault) as saver:
        receipt_graph(saver).invoke(None, _alice())
    assert RECEIVED == [EMAIL]
    with KeelCheckpointSaver(redis_url, tenant="acme") as masked:
        stored = masked.get_tuple(_alice())
        assert stored is not None and EMAIL not in repr(stored.checkpoint)


def test_a_read_after_a_write_gives_the_graph_its_own_messages_back(
    db_path: Path, vault: Vault
) -> None:
    """With the vault, what a read reveals is what the graph wrote: the saver hands back the
    graph's own message objects, so the next read and put look at what is new only."""
    with KeelCheckpointSaver(f"sqlite:///{db_path}", tenant="acme", vault=vault) as saver:
        graph = receipt_graph(saver)
        state = graph.invoke({"messages": [HumanMessage(content=f"mail {EMAIL}")]}, _alice())
        found = saver.get_tuple(_alice())
        assert found is not None
        read = found.checkpoint["channel_values"]["messages"]
        assert [m.content for m in read] == [f"mail {EMAIL}", "Noted."]
        assert all(mine is theirs for mine, theirs in zip(read, state["messages"], strict=True))


def test_without_user_id_in_the_config_the_savers_user_then_the_thread_holds_the_values(
    db_path: Path, vault: Vault
) -> None:
    url = f"sqlite:///{db_path}"
    asked = {"messages": [HumanMessage(content=f"mail {EMAIL}")]}
    for thread, user in (("t1", "alice"), ("t2", None)):
        with KeelCheckpointSaver(url, tenant="acme", vault=vault, user=user) as saver:
            receipt_graph(saver).invoke(asked, {"configurable": {"thread_id": thread}})

    def first_text(thread: str, user: str | None) -> str:
        with KeelCheckpointSaver(url, tenant="acme", vault=vault, user=user) as saver:
            state = receipt_graph(saver).get_state({"configurable": {"thread_id": thread}})
            return str(state.values["messages"][0].content)

    assert first_text("t1", "alice") == f"mail {EMAIL}"
    assert first_text("t1", None) == "mail <EMAIL_1>", "the thread t1 is not the user alice"
    assert first_text("t2", None) == f"mail {EMAIL}", "the thread names its user"
    assert first_text("t2", "alice") == "mail <EMAIL_1>"
