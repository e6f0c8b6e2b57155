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


class _Watched(list[Message]):
    """A history that counts the messages its slices hand out (what a comparison reads)."""

    read = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        found = super().__getitem__(key)
        if isinstance(key, slice):
            type(self).read += len(found)
        return found


def _blocks_around(history: list[Message]) -> tuple[list[Message], list[tuple[int, int, int]]]:
    """A prompt as the context engine builds one (blocks, the window with a pruned output,
    the rules before the newest user message) and its runs (`CompiledPrompt.held`)."""
    system, summary, rules = (
        Message.system("you are"),
        Message.system("summary"),
        Message.system("r"),
    )
    pruned = Message.user("[pruned]")
    prompt = [system, summary, *history[100:600], pruned, *history[601:-1], rules, history[-1]]
    end = 3 + 500 + len(history) - 602
    runs = [(2, 100, 500), (503, 601, len(history) - 602), (end + 1, len(history) - 1, 1)]
    return prompt, runs


def test_known_runs_record_the_prompt_without_comparing_the_window() -> None:
    history = _Watched(_history(3_000))
    prompt, runs = _blocks_around(history)
    expected = prompt_record(prompt, list(history))

    _Watched.read = 0
    record = prompt_record(tuple(prompt), history, runs)

    assert record == expected
    # Without the runs each run of the window is compared, as lists: 2,900 messages read.
    assert _Watched.read == 0


def test_runs_that_are_wrong_or_short_change_nothing() -> None:
    history = _history(1_000)
    prompt, runs = _blocks_around(history)
    expected = prompt_record(prompt, history)
    # A run found short, one said to go on past a pruned output, runs off by one message,
    # runs of another history: followed as far as they hold, compared past that.
    for given in (
        [(2, 100, 200), *runs[1:]],
        [(2, 100, len(prompt))],
        [(index, number + 1, length) for index, number, length in runs],
        [(index + 1, number, length) for index, number, length in runs],
        [(0, 0, len(prompt))],
        [],
    ):
        assert prompt_record(tuple(prompt), history, given) == expected, given


def test_an_equal_copy_after_a_known_run_continues_it_as_a_comparison_would() -> None:
    history = _history(300)
    # The message after the run is an equal copy, not the object: a list comparison passes
    # it, and so does the record with runs.
    prompt = [Message.system("you are"), *history[:200], history[200].model_copy(), *history[201:]]

    record = prompt_record(prompt, history, [(1, 0, 200), (202, 201, 99)])

    assert (
        record
        == prompt_record(prompt, history)
        == [
            Message.system("you are").to_openai(),
            {"messages": [0, 299]},
        ]
    )


def test_a_long_block_kept_again_is_the_same_text() -> None:
    history = _history(10)
    summary = Message.system("s" * (KEPT_CHARS + 50))

    first = prompt_record([summary, *history], history)
    again = prompt_record([summary, *history[1:]], history)

    # One string for the block's kept text from step to step: its hash and UTF-8 (what the
    # redaction's look-up and the trace's JSON need) are computed once, not at every step.
    assert first[0]["content"] is again[0]["content"]
