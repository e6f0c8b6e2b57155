"""``keel bench tau2``: τ²-bench retail tasks through keel, and the grounded oracle's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.bench.tau2._customer import first_message
from keel.bench.tau2._data import GoldAction, Task, load_policy, load_tasks
from keel.bench.tau2._oracle import FINAL, GroundedOracle, attribute_placeholders
from keel.messages import Message, ToolCall
from keel.models import ModelOptions
from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from tests.bench._cli import bench_json

_EMAIL = "yusuf.rossi7301@example.com"


def test_the_first_train_tasks_match_clean_and_killed_with_nothing_doubled_or_missing() -> None:
    # Seed 0 kills task 0 at its 5th model call and task 1 inside its first write, after the
    # server applied it; a new process continues each.
    figures = bench_json("tau2", "--tasks", "2", "--mode", "clean,kill", "--seed", "0")
    assert figures["domain"] == "retail" and figures["split"] == "train"
    assert figures["kill_points"] == {"0": "step:5", "1": "write:1"}
    for mode in ("clean", "kill"):
        row = figures["modes"][mode]
        assert row["tasks"] == 2 and row["db_match"] == 2, figures["failures"]
        assert row["doubled_writes"] == 0 and row["missing_writes"] == 0
        assert row["placeholder_args"] == 0 and row["ungrounded_calls"] == 0
        assert row["seconds"] > 0
    assert figures["modes"]["clean"]["kills"] == 0 and figures["modes"]["kill"]["kills"] == 2


def _task(*actions: GoldAction, known: str = "I am Yusuf Rossi in zip code 19122.") -> Task:
    return Task(
        id="t", reason_for_call="I want my order checked.", known_info=known, actions=actions
    )


def _decide(oracle: GroundedOracle, *messages: Message) -> Message | str:
    call = ScriptedCall((Message.system(load_policy()), *messages), (), ModelOptions())
    reply = oracle.decide(call)
    assert isinstance(reply, Message | str)
    return reply


def _arguments(reply: Message | str) -> tuple[str, dict[str, object]]:
    assert isinstance(reply, Message) and len(reply.tool_calls) == 1, reply
    return reply.tool_calls[0].name, json.loads(reply.tool_calls[0].arguments)


def test_a_value_the_prompt_does_not_show_is_counted_never_invented() -> None:
    # The customer never gave an email and no lookup of the store shows one (no customer id
    # in the gold calls): the call is skipped and counted, the address never sent.
    task = _task(GoldAction("find_user_id_by_email", {"email": "nobody.known@example.com"}))
    oracle = GroundedOracle(task, [first_message(task)])
    reply = _decide(oracle, Message.user(first_message(task)))
    assert reply == FINAL
    assert oracle.ungrounded == {0}


def test_a_value_the_prompt_shows_is_copied_from_it() -> None:
    task = _task(
        GoldAction(
            "find_user_id_by_name_zip",
            {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"},
        )
    )
    oracle = GroundedOracle(task, [first_message(task)])
    name, arguments = _arguments(_decide(oracle, Message.user(first_message(task))))
    assert name == "find_user_id_by_name_zip"
    assert arguments == {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"}
    assert oracle.ungrounded == set()


def test_a_masked_value_is_passed_as_the_placeholder_the_prompt_shows() -> None:
    raw = f"Hi. My email is {_EMAIL}, please look me up."
    task = _task(GoldAction("find_user_id_by_email", {"email": _EMAIL}), known=raw)
    oracle = GroundedOracle(task, [raw])
    masked = "Hi. My email is <EMAIL_1>, please look me up."
    assert attribute_placeholders(masked, [raw]) == {"<EMAIL_1>": _EMAIL}
    name, arguments = _arguments(_decide(oracle, Message.user(masked)))
    assert (name, arguments) == ("find_user_id_by_email", {"email": "<EMAIL_1>"})


def test_a_value_only_a_lookup_shows_is_looked_up_first() -> None:
    # Task 72 lists only its writes: the order id is in the customer's profile, which the
    # oracle reads (after finding the customer by name and zip) before it asks to confirm.
    task = next(t for t in load_tasks("retail", "train") if t.id == "72")
    oracle = GroundedOracle(task, [first_message(task)])
    name, arguments = _arguments(_decide(oracle, Message.user(first_message(task))))
    assert name == "find_user_id_by_name_zip"
    assert arguments == {"first_name": "Ivan", "last_name": "Khan", "zip": "28243"}


def test_a_write_waits_for_the_customers_yes() -> None:
    task = _task(
        GoldAction("cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"})
    )
    oracle = GroundedOracle(task, [])
    asked = _decide(oracle, Message.user("Please cancel order #W1, I no longer need it."))
    assert isinstance(asked, str) and asked.endswith("Please answer yes or no.")
    name, _ = _arguments(
        _decide(
            oracle,
            Message.user("Please cancel order #W1, I no longer need it."),
            Message.assistant(asked),
            Message.user("yes"),
        )
    )
    assert name == "cancel_pending_order"


def test_placeholders_side_by_side_are_told_apart() -> None:
    # Task 54's shape: the text between the two (" and ") comes earlier in the message too.
    raw = "I am Amelia, and I have two emails: a.one@example.com and a.two@example.com."
    masked = "I am Amelia, and I have two emails: <EMAIL_1> and <EMAIL_2>."
    assert attribute_placeholders(masked, [raw]) == {
        "<EMAIL_1>": "a.one@example.com",
        "<EMAIL_2>": "a.two@example.com",
    }


def test_a_call_keel_showed_with_placeholders_for_its_values_is_not_made_again() -> None:
    # Task 34's shape: the customer's words show the name as written ("called Noah Patel"),
    # keel masks the oracle's own arguments after "first_name"; the call was made, once.
    known = "I am an interesting guy called Noah Patel, living in the Big Apple in 10108."
    find = GoldAction(
        "find_user_id_by_name_zip", {"first_name": "Noah", "last_name": "Patel", "zip": "10108"}
    )
    task = _task(find, GoldAction("get_user_details", {"user_id": "noah_patel_6952"}), known=known)
    oracle = GroundedOracle(task, [known])
    masked = json.dumps({"first_name": "<PERSON_1>", "last_name": "<PERSON_2>", "zip": "10108"})
    made = ToolCall(id="call_1", name=find.name, arguments=masked)
    call = Message.assistant("", tool_calls=[made])
    reply = _decide(
        oracle,
        Message.user(known),
        call,
        Message.tool("call_1", "noah_patel_6952"),
    )
    assert _arguments(reply) == ("get_user_details", {"user_id": "noah_patel_6952"})


async def test_an_operator_settles_a_masked_write_by_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Task 22 killed inside its third write: the journal keeps the address masked, the
    # server's call log has it as sent. Compared masked, the write read as never made, and
    # ran again (a doubled write).
    from keel.bench.tau2 import _run

    sent = {"user_id": "ethan_garcia_1261", "address1": "667 Highland Drive", "zip": "80280"}
    log = [
        {
            "tau2_tool_call": {"name": "modify_user_address", "arguments": sent},
            "tau2_tool_message": {"error": False, "content": "address updated"},
        }
    ]

    async def call_log(state_dir: Path, key: str) -> list[dict[str, object]]:
        return log

    monkeypatch.setattr(_run, "call_log", call_log)
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}", model=ScriptedModel(["ok"]), system_prompt="s"
    )
    try:
        assert agent.vault is not None and agent.journal is not None
        shown = agent.vault.user(agent.tenant_id, _run.USER).placeholder(
            "ADDRESS", "667 Highland Drive"
        )
        masked = json.dumps({**sent, "address1": shown})
        agent.journal.claim(
            key="k1",
            session_id=agent.session_key("s"),
            step=3,
            call_index=0,
            tool="modify_user_address",
            arguments=masked,
        )
        settled = await _run.settle_from_call_log(tmp_path, "key")(agent, "s")
        entry = agent.journal.get("k1")
    finally:
        await agent.aclose()
    assert settled == 1 and entry is not None
    assert (entry.status, entry.content) == ("succeeded", "address updated")
