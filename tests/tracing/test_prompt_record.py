"""What a model step keeps of its prompt (``prompt_record``): the session's stored messages
as position ranges wherever they sit in the prompt, every other message whole, long blocks
cut, so a step's record and its cost stay the size of its blocks as the session grows."""

from __future__ import annotations

from keel.messages import Message
from keel.tracing._loop import KEPT_CHARS, prompt_record


def _history(n: int) -> list[Message]:
    return [Message.user(f"u{i}") if i % 2 == 0 else Message.assistant(f"a{i}") for i in range(n)]


def test_the_turns_are_ranges_around_the_blocks() -> None:
    history = _history(3_000)
    system, rules = Message.system("you are"), Message.system("rules")
    prompt = [system, *history[40:-1], rules, history[-1]]

    record = prompt_record(prompt, history)

    assert record == [
        system.to_openai(),
        {"messages": [40, 2_998]},
        rules.to_openai(),
        {"messages": [2_999, 2_999]},
    ]


def test_a_substituted_message_is_kept_whole_and_the_run_resumes_after_it() -> None:
    history = _history(500)
    pruned = Message.user("[pruned]")
    prompt = [*history[100:300], pruned, *history[301:]]

    record = prompt_record(prompt, history)

    assert record == [
        {"messages": [100, 299]},
        pruned.to_openai(),
        {"messages": [301, 499]},
    ]


def test_a_long_block_is_cut_and_says_how_much() -> None:
    history = _history(10)
    summary = Message.system("s" * (KEPT_CHARS + 1_234))

    record = prompt_record([summary, *history], history)

    assert record[0]["content"] == "s" * KEPT_CHARS
    assert record[0]["cut_chars"] == 1_234
    assert record[1] == {"messages": [0, 9]}


def test_a_prompt_of_copies_is_kept_whole() -> None:
    history = _history(20)
    copies = [message.model_copy() for message in history]

    record = prompt_record(copies, history)

    assert record == [message.to_openai() for message in copies]


def test_the_viewer_says_a_kept_block_was_cut() -> None:
    from keel.ui._views import _prompt_message

    wire = {"role": "system", "content": "s" * KEPT_CHARS, "cut_chars": 1_234}

    shown = _prompt_message(1, wire)

    assert shown.content.endswith("[... 1,234 more characters were sent, not kept]")


def test_a_prompt_given_as_a_tuple_is_recorded_as_a_list_would_be() -> None:
    history = _history(400)
    pruned = Message.user("[pruned]")
    prompt = (Message.system("you are"), *history[:150], pruned, *history[151:])

    assert prompt_record(prompt, history) == prompt_record(list(prompt), history)
    assert prompt_record(prompt, history)[1:] == [
        {"messages": [0, 149]},
        pruned.to_openai(),
        {"messages": [151, 399]},
    ]
