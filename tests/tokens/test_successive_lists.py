"""A list counted after another costs exactly what its messages cost, whatever changed between
them: blocks replaced, inserted or left out anywhere, messages moved, added or repeated.

The counter starts from the last list it counted with the same first message and looks up only
what differs; each list's count is compared with a fresh counter's, which has nothing to start
from.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keel.messages import Message
from keel.tokens import ChatTokenCounter, counter_for

_POOL = [Message.system("You answer.")] + [
    Message.user(f"message {n} " + "word " * (n % 7)) for n in range(40)
]

# An edit of the previous list: (kind, position, length, pool index).
_EDITS = st.lists(
    st.tuples(
        st.sampled_from(["replace", "insert", "delete", "move", "append", "truncate"]),
        st.integers(0, 60),
        st.integers(1, 12),
        st.integers(0, len(_POOL) - 1),
    ),
    min_size=1,
    max_size=4,
)


def _edited(previous: list[Message], edits: list[tuple[str, int, int, int]]) -> list[Message]:
    messages = list(previous)
    for kind, position, length, index in edits:
        at = position % (len(messages) + 1)
        fresh = Message.user(f"fresh {index} at {position}")
        if kind == "replace" and messages:
            messages[at % len(messages)] = fresh
        elif kind == "insert":
            messages[at:at] = [_POOL[index], fresh][: 1 + length % 2]
        elif kind == "delete":
            del messages[at : at + length]
        elif kind == "move" and messages:
            messages.insert(at, messages.pop(position % len(messages)))
        elif kind == "append":
            messages += _POOL[index : index + length]
        elif kind == "truncate":
            del messages[len(messages) - length % (len(messages) + 1) :]
    return messages


@given(st.lists(_EDITS, min_size=1, max_size=8))
def test_each_list_costs_what_a_fresh_counter_says(steps: list[list[tuple]]) -> None:
    counter = counter_for("gpt-4o-mini")
    messages = [_POOL[0], *_POOL[1:30]]
    assert counter.count_messages(messages) == _fresh(counter).count_messages(messages)
    for edits in steps:
        messages = _edited(messages, edits)
        if messages and messages[0] is not _POOL[0]:
            messages.insert(0, _POOL[0])  # most lists start from the same system prompt
        expected = _fresh(counter).count_messages(messages)
        assert counter.count_messages(messages) == expected, (edits, len(messages))


def _fresh(counter: ChatTokenCounter) -> ChatTokenCounter:
    return ChatTokenCounter(counter.profile, counter.tokenizer)


def test_a_tuple_is_kept_as_it_is_for_the_next_count() -> None:
    counter = counter_for("gpt-4o-mini")
    prompt = tuple(_POOL[:30])

    counter.count_messages(prompt)

    # A compiled prompt's tuple cannot change under the next count: kept, not copied (a copy
    # of the window at every model call the counter follows).
    assert counter._last_lists[id(prompt[0])][0] is prompt
